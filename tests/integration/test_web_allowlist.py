"""``env=web`` reaches only the seeded sites (issue 31, item 10).

A private service on 127.0.0.1 (this test's tiny HTTP server, another port, answering a secret
to anything, CORS open) stands for the host's network.  The attacks: ``goto`` it under every
spelling, a page of an allowed site that redirects to it (one hop and a chain, which
Playwright's routing does not see), and a page whose script, images, iframes, worker, popup,
beacon and websocket reach for it.  Asserted: the private service receives no request at all,
its secret is in no observation or frame, the agent reads why, and the sites still work.
Skips only when no chromium binary is installed."""

from __future__ import annotations

import html
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from turnscale.envhub.web import WebFamily
from turnscale.envhub.web_browser import BrowserPool, accessibility_tree, execute
from turnscale.envhub.webarena_actions import parse_action

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")
SECRET = "PRIVATE-SERVICE-SECRET-7f3a9c"


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def _serve(handler: type[BaseHTTPRequestHandler]) -> _Server:
    srv = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, name=f"test-{handler.__name__}", daemon=True).start()
    return srv


class Private(BaseHTTPRequestHandler):
    """The host's private service: the secret to any request; ``hits`` records each one."""

    hits: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        Private.hits.append(f"{self.command} {self.path}")
        body = f"<html><body><p>{SECRET}</p></body></html>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_HEAD = do_PUT = _answer


_SCRIPT = """
const out = document.getElementById('out');
const log = (k, v) => { const li = document.createElement('li'); li.textContent = k + ': ' + v; out.appendChild(li); };
const S = %(secret)s;
const bounded = (k, p) => Promise.race([p, new Promise(r => setTimeout(() => r(log(k, 'no answer')), 4000))]);
const tries = [
  bounded('fetch', fetch(S).then(r => r.text()).then(t => log('fetch', t), () => log('fetch', 'refused'))),
  bounded('fetch-redirect', fetch('/redirect?to=' + encodeURIComponent(S)).then(r => r.text())
          .then(t => log('fetch-redirect', t), () => log('fetch-redirect', 'refused'))),
  bounded('xhr', new Promise(res => { const x = new XMLHttpRequest(); x.open('GET', S);
          x.onload = () => res(log('xhr', x.responseText)); x.onerror = () => res(log('xhr', 'refused')); x.send(); })),
  bounded('worker', new Promise(res => { const w = new Worker('/worker.js');
          w.onmessage = m => res(log('worker', m.data)); w.onerror = () => res(log('worker', 'error')); })),
  bounded('ws', new Promise(res => { try { const ws = new WebSocket(S.replace('http', 'ws'));
          ws.onmessage = m => res(log('ws', m.data)); ws.onerror = () => res(log('ws', 'refused')); }
          catch (e) { res(log('ws', 'refused')); } })),
  bounded('sw', navigator.serviceWorker ? navigator.serviceWorker.register('/sw.js').then(() => log('sw', 'registered'),
          () => log('sw', 'refused')) : Promise.resolve(log('sw', 'unavailable'))),
];
navigator.sendBeacon(S, 'x');
window.open(S);
Promise.all(tries).then(() => { document.title = 'done'; });
"""


class Seeded(BaseHTTPRequestHandler):
    """A test-only site on the allow-list, playing a seeded page gone bad: open redirects and
    a page whose sub-resources and scripts reach for the private service."""

    secret_url = ""

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: str, ctype: str = "text/html", headers: dict | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        u = urlsplit(self.path)
        to = parse_qs(u.query).get("to", [self.secret_url])[0]
        s = self.secret_url
        if u.path == "/redirect":
            return self._send(302, "", headers={"Location": to})
        if u.path == "/chain":  # an allowed hop first: Playwright routes only a chain's first URL
            return self._send(302, "", headers={"Location": f"/redirect?to={quote(to, safe='')}"})
        if u.path == "/worker.js":
            return self._send(200, f"fetch({s!r}).then(r => r.text()).then(t => postMessage(t), () => postMessage('refused'));",
                              "text/javascript")
        if u.path == "/sw.js":
            return self._send(200, f"self.addEventListener('install', () => fetch({s!r}));", "text/javascript")
        if u.path == "/script":
            e = html.escape(s)
            return self._send(200, f"<!doctype html><html><head><title>Script</title><link rel=prefetch href='{e}'></head><body>"
                                   f"<img src='{e}' alt=pic><iframe src='{e}'></iframe><iframe src='/chain?to={quote(s, safe='')}'>"
                                   f"</iframe><a ping='{e}' href='#x'>ping</a><ul id=out></ul>"
                                   f"<script>{_SCRIPT % {'secret': repr(s)}}</script></body></html>")
        return self._send(200, "<!doctype html><html><head><title>Seeded</title></head><body><h1>Seeded home</h1></body></html>")


@pytest.fixture(scope="module")
def private():
    srv = _serve(Private)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def _no_hits():
    Private.hits.clear()
    yield
    assert Private.hits == [], f"the private service was reached: {Private.hits}"


@pytest.fixture(scope="module")
def family():
    fam = WebFamily(CHROMIUM)
    yield fam
    fam.close()


@pytest.fixture(scope="module")
def seeded(private):
    """``(pool, session, base)``: a browser whose allow-list is the test-only seeded site."""
    Seeded.secret_url = private + "/"
    srv = _serve(Seeded)
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    pool = BrowserPool(CHROMIUM, allowed_origins=(base,), nav_timeout_s=10.0)
    s = pool.new_session()
    yield pool, s, base
    pool.close()
    srv.shutdown()
    srv.server_close()


def _spellings(private: str) -> list[str]:
    port = urlsplit(private).port
    return [f"http://127.0.0.1:{port}/", f"http://localhost:{port}/", f"http://LocalHost.:{port}/x", f"http://[::1]:{port}/",
            f"http://2130706433:{port}/", f"http://0x7f000001:{port}/", f"http://0177.0.0.1:{port}/", f"http://127.1:{port}/",
            f"http://0.0.0.0:{port}/", f"http://user@127.0.0.1:{port}/", f"http://[::ffff:127.0.0.1]:{port}/",
            "http://10.0.0.1/", "http://169.254.169.254/latest/meta-data/", "http://192.168.1.1/",
            "file:///etc/passwd", "chrome://version", "data:text/html,<p>hi</p>", "javascript:alert(1)",
            f"view-source:http://127.0.0.1:{port}/", f"ws://127.0.0.1:{port}/"]


def test_goto_outside_the_seeded_sites_is_blocked_under_every_spelling(family, private):
    env = family.create()
    first = env.reset(2).observation
    base = family.sites.base
    before = family.refused()["goto"]
    port = urlsplit(base).port
    urls = _spellings(private) + [f"http://localhost:{port}/shop/", f"https://127.0.0.1:{port}/shop/", f"http://127.0.0.1:{port + 1}/"]
    for url in urls:
        out = env.step(f"```goto [{url}]```")
        assert out.observation.startswith(f"blocked: {url} is outside the allowed sites ({base}/)"), (url, out.observation[:300])
        assert SECRET not in out.observation
        assert (out.done, out.reward, out.info["valid"]) == (False, 0.0, False)
        assert out.observation.split("OBSERVATION:", 1)[1] == first.split("OBSERVATION:", 1)[1].replace(  # the page stayed
            "PREVIOUS ACTION: None", f"PREVIOUS ACTION: goto [{url}]")
    assert family.refused()["goto"] - before == len(urls)
    assert f"URL: {base}/forum/" in env.step(f"```goto [{base}/forum/]```").observation  # the sites still work
    env.close()


def _observe(pool: BrowserPool, s) -> str:
    async def grab() -> str:
        return await accessibility_tree(s, viewport_only=False)

    return pool.call(grab(), timeout_s=30)


def _frames_text(pool: BrowserPool, s) -> str:
    """Every frame of every page of the session's context (popups included)."""
    async def grab() -> str:
        parts = []
        for page in s.context.pages:
            for frame in page.frames:
                try:
                    parts.append(f"{frame.url}\n{await frame.content()}")
                except Exception as exc:  # a frame detached meanwhile
                    parts.append(f"{frame.url}\n<{exc}>")
        return "\n".join(parts)

    return pool.call(grab(), timeout_s=30)


@pytest.mark.parametrize("path, hop", [("/redirect", "http://127.0.0.1:{port}/"), ("/chain", "http://127.0.0.1:{port}/"),
                                       ("/redirect?to=http%3A%2F%2Flocalhost%3A{port}%2F", "http://localhost:{port}/"),
                                       ("/chain?to=http%3A%2F%2F2130706433%3A{port}%2F", "http://127.0.0.1:{port}/")])
def test_a_seeded_page_that_redirects_to_the_private_service_shows_the_blocked_page(seeded, private, path, hop):
    pool, s, base = seeded
    port = urlsplit(private).port
    pool.guard.recent.clear()
    pool.call(execute(s, parse_action(f"goto [{base}{path.format(port=port)}]"), 10.0), timeout_s=30)
    tree = _observe(pool, s)
    assert "outside the allowed sites" in tree and SECRET not in tree, tree
    assert SECRET not in _frames_text(pool, s)
    assert hop.format(port=port) in pool.guard.recent  # the hop routing never saw, refused at the proxy


def test_scripts_subresources_workers_and_popups_of_a_seeded_page_cannot_reach_the_private_service(seeded, private):
    pool, s, base = seeded
    pool.call(execute(s, parse_action(f"goto [{base}/script]"), 10.0), timeout_s=30)
    pool.call(s.page.wait_for_function("document.title === 'done'", timeout=15000), timeout_s=30)
    time.sleep(0.5)  # the beacon, prefetch and popup are fire-and-forget; give them time to try
    tree, frames = _observe(pool, s), _frames_text(pool, s)
    assert SECRET not in tree and SECRET not in frames
    for k in ("fetch", "fetch-redirect", "xhr", "worker", "ws"):
        assert f"{k}: refused" in frames, (k, frames[-2000:])
    assert pool.guard.refused["route"] >= 4 and pool.guard.refused["proxy"] >= 1
    pool.call(execute(s, parse_action(f"goto [{base}/]"), 10.0), timeout_s=30)
    assert "Seeded home" in _observe(pool, s)  # the allowed site still works
