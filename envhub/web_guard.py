"""``env=web``'s network boundary: the browser reaches only the seeded sites.

The allow-list is a set of exact origins (scheme, host, port): the sites process's
``http://127.0.0.1:<port>``.  A URL is allowed iff its origin, as chromium writes it
(canonical), is one of them; names are never resolved, so ``localhost``, ``[::1]``,
``0.0.0.0``, other ports of 127.0.0.1, private and link-local addresses, decimal or hex IP
spellings (``http://2130706433/``), and every other scheme (``https:``, ``ws:``, ``data:``,
``blob:``, ``file:``, ``chrome:``) are refused.

Three layers enforce it; each refuses what it sees, together they see every request:

1. ``Guard.check_goto``: the ``goto`` action is checked before the browser is asked, so a
   refused URL is never fetched and the agent reads why (``BlockedURL``).
2. ``Guard.route``, installed with ``context.route("**/*")`` on every context: navigations
   (links, forms, iframes, popups), sub-resources and fetch/XHR.  A refused navigation is
   answered with ``blocked_page`` (status 403, no byte of the target), anything else aborted.
3. ``GuardProxy``: chromium's only way to the network (launched with it as proxy, loopback
   included).  It sees what routing does not: every hop of a redirect chain (Playwright routes
   only a chain's first URL), service workers' and workers' requests, beacons, prefetches;
   ``CONNECT`` (https, websockets) is refused.  It forwards an allowed request to that exact
   origin and answers any other with ``blocked_page``.

``Guard.refused`` counts refusals per layer (the server's ``/metrics``, ``web_refused``; the
proxy's count includes chromium's own background requests, e.g. component updates), and
``Guard.recent`` keeps the last ``RECENT`` refused URLs (logs, tests).
"""

from __future__ import annotations

import asyncio
import html
import logging
from collections import deque
from typing import Any, Iterable
from urllib.parse import urlsplit

log = logging.getLogger("envhub")

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
MAX_HEAD = 64 * 1024
"""Bytes of a request or response head the proxy reads (more: the connection is dropped)."""
MAX_BODY = 1 << 20
"""Bytes of a request body the proxy forwards (the sites take 64 KiB; more: 413)."""
RECENT = 64
"""Refused URLs kept in ``Guard.recent``."""
_HOP_HEADERS = {"connection", "proxy-connection", "keep-alive", "proxy-authorization", "te", "trailer", "upgrade"}


class BlockedURL(ValueError):
    """A ``goto`` to a URL outside the allowed sites (the message is shown to the agent)."""


def origin(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of an absolute URL (scheme and host lower-cased, the scheme's
    default port filled in), or ``None`` for a URL without a network origin or a bad port."""
    try:
        u = urlsplit(url.strip())
        scheme, host, port = u.scheme.lower(), (u.hostname or "").lower(), u.port
    except ValueError:
        return None
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    return scheme, host, port if port is not None else _DEFAULT_PORTS[scheme]


class AllowList:
    """Exact origins; ``allows(url)`` compares a URL's origin with them, nothing else."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins: dict[tuple[str, str, int], str] = {}
        for o in origins:
            key = origin(o)
            if key is None or key[0] != "http" or urlsplit(o).path not in ("", "/"):
                raise ValueError(f"allowed origin {o!r}: expected a bare http origin such as http://127.0.0.1:8080")
            self.origins[key] = o.rstrip("/")

    def allows(self, url: str) -> bool:
        return origin(url) in self.origins

    def __str__(self) -> str:
        return ", ".join(f"{o}/" for o in self.origins.values()) or "none"


def blocked_message(url: str, allow: AllowList) -> str:
    return f"blocked: {url[:300]} is outside the allowed sites ({allow}); only these sites can be visited."


def blocked_page(url: str, allow: AllowList) -> str:
    """The page shown for a refused navigation: the reason, never the target's content."""
    msg = html.escape(blocked_message(url, allow))
    return f"<!doctype html><html><head><meta charset=utf-8><title>Blocked</title></head><body><h1>Blocked</h1><p>{msg}</p></body></html>"


class Guard:
    """The allow-list with its counters and the routing handler (runs on the pool's loop)."""

    def __init__(self, allowed_origins: Iterable[str]) -> None:
        self.allow = AllowList(allowed_origins)
        self.refused = {"goto": 0, "route": 0, "proxy": 0}
        self.recent: deque[str] = deque(maxlen=RECENT)

    def count(self, layer: str, url: str) -> None:
        self.refused[layer] += 1
        self.recent.append(url[:300])
        log.info("web guard (%s): refused %s", layer, url[:200])

    def check_goto(self, url: str) -> None:
        """Raise ``BlockedURL`` (counted) unless ``url`` is on an allowed site."""
        if not self.allow.allows(url):
            self.count("goto", url)
            raise BlockedURL(blocked_message(url, self.allow))

    async def route(self, route: Any) -> None:
        """``context.route("**/*")`` handler: continue an allowed request; answer a refused
        navigation with ``blocked_page``, abort any other refused request."""
        req = route.request
        try:
            if self.allow.allows(req.url):
                await route.continue_()
                return
            self.count("route", req.url)
            if req.is_navigation_request():
                await route.fulfill(status=403, content_type="text/html; charset=utf-8", body=blocked_page(req.url, self.allow))
            else:
                await route.abort("blockedbyclient")
        except Exception as exc:  # the page or context closed meanwhile: nothing left to route
            log.debug("web guard: route of %s not completed: %s", req.url[:200], exc)


class GuardProxy:
    """An HTTP proxy on 127.0.0.1 that forwards only requests for the allow-list's origins.

    One request per connection (answers carry ``Connection: close``); the upstream is the
    allowed origin itself (its host is an address: nothing is resolved).  Bounds: heads
    ``MAX_HEAD``, bodies ``MAX_BODY``, every read ``timeout_s``."""

    def __init__(self, guard: Guard, timeout_s: float) -> None:
        self.guard, self.timeout_s = guard, timeout_s
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=MAX_HEAD)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
            method, target, headers = _parse_head(head)
            if method == "CONNECT" or not self.guard.allow.allows(target) or _has(headers, "upgrade"):
                self.guard.count("proxy", target)
                return await _answer(writer, 403, blocked_page(target, self.guard.allow))
            await self._forward(reader, writer, method, target, headers)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError, OSError) as exc:
            log.debug("web guard proxy: connection dropped: %s", exc)
        finally:
            writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str, target: str,
                       headers: list[tuple[str, str]]) -> None:
        if _has(headers, "transfer-encoding"):
            return await _answer(writer, 411, "chunked request bodies are not supported; send Content-Length")
        n = int(_get(headers, "content-length") or 0)
        if not 0 <= n <= MAX_BODY:
            return await _answer(writer, 413, f"request body over {MAX_BODY} bytes")
        body = await asyncio.wait_for(reader.readexactly(n), self.timeout_s)
        _scheme, host, port = origin(target)  # type: ignore[misc]  # allowed, so it has one
        u = urlsplit(target)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_HEAD), self.timeout_s)
        try:
            kept = "".join(f"{k}: {v}\r\n" for k, v in headers if k.lower() not in _HOP_HEADERS)
            up_w.write(f"{method} {path} HTTP/1.1\r\n{kept}Connection: close\r\n\r\n".encode("latin-1") + body)
            await up_w.drain()
            status, rest = (await asyncio.wait_for(up_r.readuntil(b"\r\n\r\n"), self.timeout_s)).split(b"\r\n", 1)
            kept_resp = b"".join(line + b"\r\n" for line in rest.split(b"\r\n") if line and
                                 line.split(b":", 1)[0].strip().lower().decode("latin-1") not in _HOP_HEADERS)
            writer.write(status + b"\r\n" + kept_resp + b"Connection: close\r\n\r\n")
            while chunk := await asyncio.wait_for(up_r.read(65536), self.timeout_s):
                writer.write(chunk)
                await writer.drain()
        finally:
            up_w.close()


def _parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise ValueError(f"bad request line {lines[0][:100]!r}")
    headers = [(k.strip(), v.strip()) for k, sep, v in (line.partition(":") for line in lines[1:] if line) if sep]
    return parts[0].upper(), parts[1], headers


def _has(headers: list[tuple[str, str]], name: str) -> bool:
    return any(k.lower() == name for k, _ in headers)


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)


async def _answer(writer: asyncio.StreamWriter, status: int, body: str) -> None:
    data = body.encode()
    writer.write(f"HTTP/1.1 {status} Refused\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)
    await writer.drain()
