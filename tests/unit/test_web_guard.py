"""``envhub.web_guard`` without a browser: the allow-list compares exact origins, and the guard
proxy forwards only to them (one tiny upstream on 127.0.0.1; every socket ended by the test)."""

from __future__ import annotations

import asyncio

import pytest

from turnscale.envhub.web_guard import MAX_BODY, MAX_HEAD, AllowList, BlockedURL, Guard, GuardProxy, origin

SITE = "http://127.0.0.1:8123"


def test_origin_is_scheme_host_and_port_with_the_default_port_filled_in():
    assert origin("HTTP://LocalHost/x?y#z") == ("http", "localhost", 80)
    assert origin("https://[::1]:9/") == ("https", "::1", 9)
    assert origin("ws://127.0.0.1:8123/s") == ("ws", "127.0.0.1", 8123)
    for url in ("file:///etc/passwd", "data:text/html,x", "blob:http://127.0.0.1:8123/u", "chrome://version",
                "javascript:alert(1)", "http://127.0.0.1:99999/", "http:///x", "/relative"):
        assert origin(url) is None, url


@pytest.mark.parametrize("url", [f"{SITE}", f"{SITE}/", f"{SITE}/shop/?q=1", "http://user:pw@127.0.0.1:8123/x", "HTTP://127.0.0.1:8123/a"])
def test_the_allowed_origin_is_allowed_with_any_path(url):
    assert AllowList([SITE]).allows(url)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8124/", "http://127.0.0.1/", "https://127.0.0.1:8123/", "ws://127.0.0.1:8123/",
    "http://localhost:8123/", "http://[::1]:8123/", "http://0.0.0.0:8123/", "http://2130706433:8123/",
    "http://0x7f000001:8123/", "http://127.1:8123/", "http://127.0.0.1.nip.io:8123/", "http://10.0.0.1:8123/",
    "http://169.254.169.254/", "http://127.0.0.1:8123@evil.example/", "file:///etc/passwd", "data:text/html,x",
    "blob:http://127.0.0.1:8123/u", "view-source:http://127.0.0.1:8123/", "chrome://crash", ""])
def test_every_other_origin_spelling_and_scheme_is_refused(url):
    assert not AllowList([SITE]).allows(url)


@pytest.mark.parametrize("bad", ["https://127.0.0.1:1", "http://127.0.0.1:1/shop", "127.0.0.1:1", "file:///"])
def test_an_allow_list_takes_only_bare_http_origins(bad):
    with pytest.raises(ValueError, match="bare http origin"):
        AllowList([bad])


def test_check_goto_raises_a_readable_blocked_error_and_counts_it():
    g = Guard([SITE])
    g.check_goto(f"{SITE}/forum/")
    with pytest.raises(BlockedURL, match=r"^blocked: http://localhost:8123/ is outside the allowed sites \(http://127.0.0.1:8123/\)"):
        g.check_goto("http://localhost:8123/")
    assert g.refused["goto"] == 1 and list(g.recent) == ["http://localhost:8123/"]


async def _exchange(port: int, data: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        return await asyncio.wait_for(r.read(), 5.0)
    finally:
        w.close()


def _run_with_proxy(body) -> tuple[list[bytes], Guard]:
    """Start an upstream (answers ``ok <request head>``) and a proxy allowing only it; run
    ``body(proxy_port, upstream_origin)``; end both."""
    seen: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
        seen.append(head + await r.readexactly(n))
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nKeep-Alive: timeout=5\r\n\r\nok")
        await w.drain()
        w.close()

    async def main() -> Guard:
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        guard = Guard([f"http://127.0.0.1:{up.sockets[0].getsockname()[1]}"])
        proxy = GuardProxy(guard, timeout_s=5.0)
        await proxy.start()
        try:
            await body(proxy.port, f"http://127.0.0.1:{up.sockets[0].getsockname()[1]}")
        finally:
            await proxy.close()
            up.close()
        return guard

    return seen, asyncio.run(main())


def test_the_proxy_forwards_an_allowed_request_once_and_closes():
    async def body(port: int, site: str) -> None:
        out = await _exchange(port, f"POST {site}/shop/cart?x=1 HTTP/1.1\r\nHost: x\r\nProxy-Connection: keep-alive\r\n"
                                    f"Content-Length: 3\r\n\r\nabc".encode())
        assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"Connection: close\r\n\r\nok") and b"Keep-Alive" not in out

    seen, guard = _run_with_proxy(body)
    assert len(seen) == 1 and seen[0].startswith(b"POST /shop/cart?x=1 HTTP/1.1\r\nHost: x\r\n") and seen[0].endswith(b"\r\n\r\nabc")
    assert b"Proxy-Connection" not in seen[0] and b"Connection: close\r\n" in seen[0]
    assert guard.refused["proxy"] == 0


def test_the_proxy_refuses_other_origins_connect_and_upgrades_without_contacting_anyone():
    async def body(port: int, site: str) -> None:
        site_port = int(site.rsplit(":", 1)[1])
        for req in (f"GET http://localhost:{site_port}/ HTTP/1.1\r\n\r\n", f"GET http://127.0.0.1:{site_port + 1}/ HTTP/1.1\r\n\r\n",
                    f"CONNECT 127.0.0.1:{site_port} HTTP/1.1\r\n\r\n", f"GET {site}/ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
                    "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
            out = await _exchange(port, req.encode())
            assert out.startswith(b"HTTP/1.1 403 ") and b"outside the allowed sites" in out, (req, out[:200])

    seen, guard = _run_with_proxy(body)
    assert seen == [] and guard.refused["proxy"] == 5


def test_the_proxy_bounds_heads_and_bodies():
    async def body(port: int, site: str) -> None:
        assert (await _exchange(port, f"POST {site}/ HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())).startswith(b"HTTP/1.1 413 ")
        assert (await _exchange(port, f"POST {site}/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode())).startswith(b"HTTP/1.1 411 ")
        assert await _exchange(port, b"GET " + b"a" * (MAX_HEAD + 10)) == b""  # dropped, nothing answered
        assert await _exchange(port, b"nonsense\r\n\r\n") == b""

    seen, _guard = _run_with_proxy(body)
    assert seen == []
