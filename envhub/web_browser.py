"""One real browser per env server (Debian's chromium through Playwright), one isolated context
per env instance, and WebArena's observation (accessibility tree) and action execution.

Threading: Playwright's objects belong to one event loop.  ``BrowserPool`` runs an asyncio loop
in its own thread and owns Playwright, the browser and every context; env calls (from the
server's worker threads) submit coroutines with ``pool.call`` and wait with a deadline, so
instances run concurrently and no Playwright object crosses threads.

Failure model (invariants):

- A crashed page or a closed context makes only its ``Session`` broken: its calls raise
  ``BrowserBroken`` (the server then marks that instance broken); other sessions go on.
- A dead browser process (killed, crashed) breaks every session that lived in it; the next
  ``new_session`` launches a fresh browser (``relaunches`` counts them), so new instances work.
- The browser is launched from ``executable`` (never downloaded) with ``CHROMIUM_ARGS`` plus a
  marker switch naming this pool, which is how ``browser_pids`` finds its processes (memory
  accounting, tests that kill it).

Network (``envhub.web_guard``): the browser reaches only ``allowed_origins``.  The pool starts
its ``GuardProxy`` on its loop before the browser and launches chromium with it as the proxy
for everything, loopback included; every context blocks service workers and routes every
request through ``Guard.route``; ``execute`` checks ``goto`` URLs first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from turnscale.envhub.web_guard import Guard, GuardProxy

log = logging.getLogger("envhub")

CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--dns-prefetch-disable", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                 "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
                 "--webrtc-ip-handling-policy=disable_non_proxied_udp",
                 "--disable-features=AutofillServerCommunication,OptimizationHints,MediaRouter,Translate")
"""Chromium switches.  From ``--dns-prefetch-disable`` on: no name lookups but 127.0.0.1, no
WebRTC UDP (it would bypass the proxy), none of chromium's own calls home that the guard proxy
would otherwise refuse and count.  The allow-list itself is ``envhub.web_guard`` (routing and
the guard proxy)."""
MAX_TABS = 8
"""Tabs per instance (bounds an instance's browser memory)."""
IGNORED_PROPERTIES = ("focusable", "editable", "readonly", "level", "settable", "multiline", "invalid", "url")
"""WebArena's ``IGNORED_ACTREE_PROPERTIES`` plus ``url`` (newer chromium reports every link's URL; the
page's own URL is in the observation's ``URL:`` line)."""
_PRUNED_ROLES = ("generic", "img", "list", "strong", "paragraph", "banner", "navigation", "Section",
                 "LabelText", "Legend", "listitem", "none", "LineBreak", "InlineTextBox")


class BrowserBroken(RuntimeError):
    """The session's page crashed or its browser died; the instance cannot continue."""


class ElementError(ValueError):
    """An action named an element that is not on the page (shown to the agent, not a crash)."""


_BOX_JS = """function() {
  const el = this.nodeType === 3 ? this.parentElement : this;
  el.scrollIntoView({block: 'center', inline: 'center'});
  const r = el.getBoundingClientRect();
  const nav = !!(el.closest('a[href]') || (el.closest('button,input[type=submit]') && el.closest('form')));
  return [r.left + r.width / 2, r.top + r.height / 2, r.width, r.height, nav, !!el.closest('form')];
}"""


@dataclass
class Session:
    """One env instance's browser context: its tabs and the last observed tree's nodes."""

    context: Any
    guard: Guard
    """The pool's allow-list (``goto`` is checked against it)."""
    pages: list = field(default_factory=list)
    active: int = 0
    nodes: dict[str, int] = field(default_factory=dict)
    """Element id (AX node id) -> backend DOM node id, from the last observation."""
    broken: str = ""
    """Why the session cannot continue ('' while healthy)."""

    @property
    def page(self) -> Any:
        return self.pages[self.active]


class BrowserPool:
    """Owns Playwright, one chromium and its guard proxy; hands out isolated contexts that reach
    only ``allowed_origins`` (exact ``http://host:port`` origins, e.g. the sites process's)."""

    def __init__(self, executable: str = "/usr/bin/chromium", *, allowed_origins: tuple[str, ...],
                 viewport: tuple[int, int] = (1280, 720), nav_timeout_s: float = 20.0) -> None:
        if not os.path.exists(executable):
            raise FileNotFoundError(f"chromium not found at {executable!r}: install Debian's chromium "
                                    "(scripts/setup.sh does as root) or set env.options.chromium")
        self.executable, self.viewport, self.nav_timeout_s = executable, viewport, nav_timeout_s
        self.marker = f"--turnscale-pool={uuid.uuid4().hex}"
        self.relaunches = 0
        self.guard = Guard(allowed_origins)
        self._proxy = GuardProxy(self.guard, timeout_s=nav_timeout_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="browser-loop", daemon=True)
        self._thread.start()
        self._pw: Any = None
        self._browser: Any = None
        self._lock: asyncio.Lock | None = None
        self.call(self._start(), timeout_s=60.0)

    # -- loop plumbing ----------------------------------------------------------------------
    def call(self, coro: Any, timeout_s: float = 60.0) -> Any:
        """Run ``coro`` on the pool's loop and wait at most ``timeout_s``."""
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), self._loop)
        return fut.result(timeout_s + 5.0)

    async def _start(self) -> None:
        from playwright.async_api import async_playwright

        self._lock = asyncio.Lock()
        await self._proxy.start()
        self._pw = await async_playwright().start()
        await self._launch()

    async def _launch(self) -> None:
        self._browser = await self._pw.chromium.launch(executable_path=self.executable, headless=True,
                                                       args=[*CHROMIUM_ARGS, self.marker],
                                                       proxy={"server": f"http://127.0.0.1:{self._proxy.port}"})
        log.info("chromium launched (%s)", self.marker)  # names this pool's processes (tests, operators)

    async def _browser_ok(self) -> Any:
        assert self._lock is not None
        async with self._lock:
            if self._browser is None or not self._browser.is_connected():
                try:
                    if self._browser is not None:
                        await self._browser.close()
                except Exception:
                    pass
                self.relaunches += 1
                await self._launch()
            return self._browser

    # -- sessions ---------------------------------------------------------------------------
    def new_session(self) -> Session:
        return self.call(self._new_session())

    async def _new_session(self) -> Session:
        browser = await self._browser_ok()
        ctx = await browser.new_context(viewport={"width": self.viewport[0], "height": self.viewport[1]},
                                        service_workers="block")
        ctx.set_default_timeout(self.nav_timeout_s * 1000)
        await ctx.route("**/*", self.guard.route)
        s = Session(ctx, self.guard)
        await self._open_page(s)
        return s

    async def _open_page(self, s: Session) -> Any:
        page = await s.context.new_page()

        def crashed(_p: Any) -> None:
            s.broken = s.broken or "the page crashed"

        page.on("crash", crashed)
        s.pages.append(page)
        s.active = len(s.pages) - 1
        return page

    def close_session(self, s: Session) -> None:
        try:
            self.call(s.context.close(), timeout_s=15.0)
        except Exception:
            pass  # the browser may be gone already

    def connected(self) -> bool:
        """Whether the browser process is alive (as far as Playwright knows)."""
        return self._browser is not None and self._browser.is_connected()

    def usable(self, s: Session) -> bool:
        """Whether ``s`` can still be used: not crashed, and its context lives in the current,
        connected browser (a session made before a relaunch belongs to the dead one)."""
        if not s.broken and (not self.connected() or s.context.browser is not self._browser):
            s.broken = "the browser process died"
        return not s.broken

    def check(self, s: Session) -> None:
        if not self.usable(s):
            raise BrowserBroken(f"browser session unusable: {s.broken}")

    def browser_pids(self) -> list[int]:
        """Pids of this pool's chromium processes: the main process (found by the marker switch)
        first, then its descendants (renderers, zygotes, utilities)."""
        parent: dict[int, int] = {}
        main: list[int] = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    parent[int(d)] = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if self.marker.encode() in argv and not any(a.startswith(b"--type=") for a in argv):
                main.append(int(d))
        out = list(main)
        for pid in out:  # breadth-first over descendants; grows while iterating
            out.extend(c for c, p in sorted(parent.items()) if p == pid and c not in out)
        return out

    def memory_bytes(self) -> int:
        """Proportional set size (PSS) of all this pool's chromium processes, in bytes."""
        total = 0
        for pid in self.browser_pids():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
            except (OSError, StopIteration, ValueError):
                pass
        return total

    def close(self) -> None:
        async def stop() -> None:
            try:
                if self._browser is not None:
                    await self._browser.close()
            finally:
                if self._pw is not None:
                    await self._pw.stop()
                await self._proxy.close()

        try:
            self.call(stop(), timeout_s=20.0)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)


# -- observation ------------------------------------------------------------------------------
async def _visible(cdp: Any) -> Any:
    """``backend node id -> bool`` (in the viewport), from one DOM snapshot's layout bounds
    (document coordinates) and the window's scroll offset and size; nodes without a layout box
    count as visible (structure such as the document itself)."""
    snap = await cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []})
    win = (await cdp.send("Runtime.evaluate", {"expression": "[scrollX, scrollY, innerWidth, innerHeight]", "returnByValue": True}))
    sx, sy, ww, wh = win["result"]["value"]
    doc = snap["documents"][0]
    backend = doc["nodes"]["backendNodeId"]
    inside: dict[int, bool] = {}
    for idx, (x, y, w, h) in zip(doc["layout"]["nodeIndex"], doc["layout"]["bounds"]):
        vis = not (x + w < sx or y + h < sy or x > sx + ww or y > sy + wh)
        inside[backend[idx]] = inside.get(backend[idx], False) or vis
    return lambda b: inside.get(b, True)


async def accessibility_tree(s: Session, viewport_only: bool = True) -> str:
    """The active page's accessibility tree in WebArena's text format (``[id] role 'name' props``,
    tab-indented), pruned and cleaned as WebArena does; records the ids in ``s.nodes``.  With
    ``viewport_only`` (WebArena's ``current_viewport_only``) nodes whose layout box lies outside
    the window are left out (their children keep their own test), so ``scroll`` reveals more."""
    cdp = await s.context.new_cdp_session(s.page)
    try:
        tree = (await cdp.send("Accessibility.getFullAXTree"))["nodes"]
        visible = await _visible(cdp) if viewport_only else (lambda b: True)
    finally:
        await cdp.detach()
    by_id = {n["nodeId"]: n for n in tree}
    s.nodes = {}
    lines: list[str] = []

    def visit(nid: str, depth: int) -> None:
        n = by_id.get(nid)
        if n is None:
            return
        role = n.get("role", {}).get("value", "")
        valid = not n.get("ignored", False) and role != "InlineTextBox" and visible(n.get("backendDOMNodeId"))
        if valid:
            name = str(n.get("name", {}).get("value", ""))
            props = [f"{p['name']}: {p['value'].get('value')}" for p in n.get("properties", [])
                     if p["name"] not in IGNORED_PROPERTIES and "value" in p.get("value", {})]
            if not name.strip() and not props and role in _PRUNED_ROLES:
                valid = False
            elif role == "listitem" and not name.strip():
                valid = False
            if valid:
                line = "\t" * depth + f"[{nid}] {role} {name!r}" + ("" if not props else " " + " ".join(props))
                lines.append(line)
                if "backendDOMNodeId" in n:
                    s.nodes[nid] = n["backendDOMNodeId"]
        for c in n.get("childIds", []):
            visit(c, depth + 1 if valid else depth)

    if tree:
        visit(tree[0]["nodeId"], 0)
    return _clean(lines)


def _clean(lines: list[str]) -> str:
    """WebArena's ``clean_accesibility_tree``: drop a StaticText line whose text already appears
    in one of the three lines before it."""
    out: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"\] StaticText '(.*)'$", line) or re.search(r'\] StaticText "(.*)"$', line)
        if m and any(m.group(1) in prev for prev in lines[max(0, i - 3):i]):
            continue
        out.append(line)
    return "\n".join(out)


async def tab_titles(s: Session) -> str:
    """WebArena's tab line: ``Tab 0 (current): title | Tab 1: title``."""
    parts = []
    for i, p in enumerate(s.pages):
        try:
            title = await p.title()
        except Exception:
            title = ""
        parts.append(f"Tab {i}{' (current)' if i == s.active else ''}: {title}")
    return " | ".join(parts)


# -- actions ------------------------------------------------------------------------------------
async def _box(s: Session, element_id: int) -> list:
    backend = s.nodes.get(str(element_id))
    if backend is None:
        raise ElementError(f"Cannot find element [{element_id}] on the current page; use an id from the observation.")
    cdp = await s.context.new_cdp_session(s.page)
    try:
        obj = (await cdp.send("DOM.resolveNode", {"backendNodeId": backend}))["object"]
        res = await cdp.send("Runtime.callFunctionOn", {"objectId": obj["objectId"], "functionDeclaration": _BOX_JS, "returnByValue": True})
    except Exception as exc:
        raise ElementError(f"Element [{element_id}] is no longer on the page.") from exc
    finally:
        await cdp.detach()
    box = res.get("result", {}).get("value")
    if not box or box[2] <= 0 or box[3] <= 0:
        raise ElementError(f"Element [{element_id}] is not visible.")
    return box


async def _maybe_nav(s: Session, nav: bool, act: Any, timeout_s: float) -> None:
    """Run ``act``; when it submits a form or follows a link, wait for the new page to load."""
    if not nav:
        await act()
        return
    try:
        async with s.page.expect_navigation(wait_until="load", timeout=timeout_s * 1000):
            await act()
    except Exception as exc:  # a navigation that never came: the page just stays
        if "Timeout" not in type(exc).__name__ and "imeout" not in str(exc):
            raise


def _key(keys: str) -> str:
    return "+".join({"ctrl": "Control", "cmd": "Meta", "meta": "Meta", "alt": "Alt", "shift": "Shift",
                     "enter": "Enter"}.get(k.lower(), k) for k in keys.split("+"))


async def execute(s: Session, a: Any, nav_timeout_s: float) -> None:
    """Apply one parsed ``envhub.webarena_actions.WebAction`` (not ``stop``) to the session."""
    page = s.page
    if a.kind in ("click", "hover", "type"):
        x, y, _w, _h, nav, in_form = await _box(s, a.element_id)
        if a.kind == "hover":
            await page.mouse.move(x, y)
        elif a.kind == "click":
            await _maybe_nav(s, bool(nav), lambda: page.mouse.click(x, y), nav_timeout_s)
        else:
            await page.mouse.click(x, y)
            await page.keyboard.type(a.text)
            if a.enter:
                await _maybe_nav(s, bool(in_form), lambda: page.keyboard.press("Enter"), nav_timeout_s)
    elif a.kind == "press":
        await page.keyboard.press(_key(a.text))
    elif a.kind == "scroll":
        await page.evaluate(f"window.scrollBy(0, {'-' if a.direction == 'up' else ''}window.innerHeight)")
    elif a.kind == "goto":
        s.guard.check_goto(a.text)
        await page.goto(a.text, wait_until="load")
    elif a.kind == "go_back":
        await page.go_back(wait_until="load")
    elif a.kind == "go_forward":
        await page.go_forward(wait_until="load")
    elif a.kind == "new_tab":
        if len(s.pages) >= MAX_TABS:
            raise ElementError(f"Cannot open a new tab: at most {MAX_TABS} tabs are allowed; close_tab first.")
        page = await s.context.new_page()
        page.on("crash", lambda _p: setattr(s, "broken", s.broken or "the page crashed"))
        s.pages.append(page)
        s.active = len(s.pages) - 1
    elif a.kind == "tab_focus":
        if not 0 <= a.tab < len(s.pages):
            raise ElementError(f"There is no tab {a.tab}; tabs are 0..{len(s.pages) - 1}.")
        s.active = a.tab
        await s.page.bring_to_front()
    elif a.kind == "close_tab":
        await page.close()
        s.pages.pop(s.active)
        if not s.pages:
            pg = await s.context.new_page()
            pg.on("crash", lambda _p: setattr(s, "broken", s.broken or "the page crashed"))
            s.pages.append(pg)
        s.active = len(s.pages) - 1
        await s.page.bring_to_front()
    else:
        raise ElementError(f"Action {a.kind!r} cannot be executed.")
