"""The local web sites of ``env=web``: a shop, a forum and a code-hosting site, plain
server-rendered HTML, served by
one sibling process of the env server (``python -m turnscale.envhub.web_sites``) on 127.0.0.1.

Isolation: every env instance browses its own copy of the sites, a *world* (``tsworld``
cookie, set by the env in the instance's browser context).  ``POST /_control/reset`` (re)creates
a world from a seed (``envhub.web_data``), ``POST /_control/drop`` forgets it (instance closed;
at most ``MAX_WORLDS`` are kept, the oldest dropped first), ``GET /_control/state`` returns its
mutable state as JSON for the evaluators; both need the ``X-Control-Token`` header (the secret the env server
passes in ``TS_WEB_TOKEN``), which the browser never sends, so the agent cannot reset or read
state.  A request without a known world gets a 403 page.

Pages (``/shop``: home + search, ``/shop/catalogue?page=&cat=&q=`` paginated, ``/shop/product/<id>``
with an add-to-cart form, ``/shop/cart`` + ``Place order``, ``/shop/orders``, ``/shop/login``,
``/shop/admin`` for the admin user; ``/forum``: forum list, ``/forum/f/<name>?page=``,
``/forum/post/<id>`` with votes and comments, ``/forum/user/<name>``, ``/forum/submit``,
``/forum/login``; ``/code``: paginated project list, ``/code/p/<name>`` with its issues filtered by
state, ``/code/issue/<id>`` with ``Close issue`` / ``Reopen issue`` forms, ``/code/search?q=``
over issue titles, ``/code/login``).  State changes only through POST forms (then 303 to a page: PRG).

The process prints ``PORT <n>`` on stdout once it listens and exits when its parent dies.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import secrets
import sys
import threading
import time
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlsplit

from turnscale.envhub.web_data import CATEGORIES, FORUMS, PAGE_SIZE, World, world

MAX_WORLDS = 256
MAX_BODY = 64 * 1024
e = html.escape


class Worlds:
    """World id -> (World, mutable state, sessions); thread-safe (one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: dict[str, dict] = {}

    def reset(self, wid: str, seed: int) -> None:
        w = world(seed)
        with self.lock:
            if wid not in self.items and len(self.items) >= MAX_WORLDS:
                self.items.pop(next(iter(self.items)))
            self.items[wid] = {"world": w, "state": w.initial_state(), "sessions": {}}

    def get(self, wid: str) -> dict | None:
        return self.items.get(wid)


def _page(title: str, site: str, user: str | None, body: str) -> str:
    if site == "shop":
        nav = ('<a href="/shop/">Home</a> <a href="/shop/catalogue">Catalogue</a> <a href="/shop/cart">Cart</a> '
               '<a href="/shop/orders">My orders</a> <a href="/shop/admin">Admin</a> ')
    elif site == "code":
        nav = ('<a href="/code/">Projects</a> <form method="get" action="/code/search">' + _input("q", "Search issues")
               + '<button type="submit">Search</button></form> ')
    else:
        nav = '<a href="/forum/">Forums</a> <a href="/forum/submit">Submit a new post</a> '
    nav += f'<span>Signed in as {e(user)}</span>' if user else f'<a href="/{site}/login">Log in</a>'
    return (f"<!doctype html><html><head><meta charset=utf-8><title>{e(title)}</title></head><body>"
            f"<nav>{nav}</nav><main><h1>{e(title)}</h1>{body}</main></body></html>")


def _form(action: str, fields: str, button: str) -> str:
    return f'<form method="post" action="{action}">{fields}<button type="submit">{e(button)}</button></form>'


def _input(name: str, label: str, kind: str = "text") -> str:
    return f'<label for="f-{name}">{e(label)}</label> <input id="f-{name}" name="{name}" type="{kind}"> '


def _pager(base: str, page: int, n_pages: int) -> str:
    sep = "&" if "?" in base else "?"
    out = []
    if page > 1:
        out.append(f'<a href="{base}{sep}page={page - 1}">Previous page</a>')
    out.append(f"<span>Page {page} of {n_pages}</span>")
    if page < n_pages:
        out.append(f'<a href="{base}{sep}page={page + 1}">Next page</a>')
    return "<div>" + " ".join(out) + "</div>"


class Handler(BaseHTTPRequestHandler):
    server_version = "turnscale-web/1"
    protocol_version = "HTTP/1.1"

    # -- plumbing -------------------------------------------------------------------------
    def log_message(self, fmt: str, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: str, ctype: str = "text/html; charset=utf-8", headers: dict | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _redirect(self, to: str, cookie: str | None = None) -> None:
        headers = {"Location": to}
        if cookie:
            headers["Set-Cookie"] = cookie
        self._send(303, "", headers=headers)

    def _cookies(self) -> dict[str, str]:
        c = SimpleCookie()
        try:
            c.load(self.headers.get("Cookie", ""))
        except Exception:
            return {}
        return {k: v.value for k, v in c.items()}

    def _form_data(self) -> dict[str, str]:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError("body too large")
        raw = self.rfile.read(n).decode("utf-8", "replace") if n else ""
        return {k: v[0] for k, v in parse_qs(raw, keep_blank_values=True).items()}

    def _control(self, method: str, path: str, query: dict) -> None:
        srv = self.server
        if not secrets.compare_digest(self.headers.get("X-Control-Token", ""), srv.token):
            return self._send(403, "forbidden", "text/plain")
        if method == "POST" and path == "/_control/reset":
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(min(n, MAX_BODY)) or b"{}")
            srv.worlds.reset(str(body["world"]), int(body["seed"]))
            return self._send(200, "{}", "application/json")
        if method == "POST" and path == "/_control/drop":
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(min(n, MAX_BODY)) or b"{}")
            with srv.worlds.lock:
                srv.worlds.items.pop(str(body["world"]), None)
            return self._send(200, "{}", "application/json")
        if method == "GET" and path == "/_control/state":
            w = srv.worlds.get(query.get("world", ""))
            if w is None:
                return self._send(404, "{}", "application/json")
            with srv.worlds.lock:
                data = json.dumps(w["state"])
            return self._send(200, data, "application/json")
        return self._send(404, "no such control route", "text/plain")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        path = url.path
        try:
            if path.startswith("/_control/"):
                return self._control(method, path, query)
            if path in ("", "/"):
                return self._send(200, _page("Sites", "forum", None, '<ul><li><a href="/shop/">Shop</a></li><li><a href="/forum/">Forum</a></li>'
                                                                 '<li><a href="/code/">Code</a></li></ul>'))
            cookies = self._cookies()
            w = self.server.worlds.get(cookies.get("tsworld", ""))
            if w is None:
                return self._send(403, _page("No world", "shop", None, "<p>This browser has no site world.</p>"))
            site = path.split("/")[1] if path.count("/") >= 1 else ""
            user = w["sessions"].get(cookies.get(f"ts_{site}", ""))
            fn = getattr(self, f"_{site}_{method.lower()}", None)
            if site not in ("shop", "forum", "code") or fn is None:
                return self._send(404, _page("Not found", "shop", None, "<p>No such page.</p>"))
            form = self._form_data() if method == "POST" else {}
            with self.server.worlds.lock:
                fn(w, user, path[len(site) + 1:] or "/", query, form)
        except (ValueError, KeyError, IndexError) as exc:
            self._send(400, _page("Bad request", "shop", None, f"<p>{e(str(exc))}</p>"))

    def _login(self, w: dict, site: str, form: dict) -> None:
        wd: World = w["world"]
        users = {"shop": (*wd.customers, wd.admin), "forum": wd.forum_users, "code": wd.developers}[site]
        u = next((x for x in users if x.name == form.get("username", "").strip()), None)
        if u is None or u.password != form.get("password", "").strip():
            return self._send(200, _page("Log in", site, None, "<p role=alert>Wrong user name or password.</p>" + _login_form(site)))
        token = secrets.token_hex(8)
        w["sessions"][token] = u.name
        self._redirect(f"/{site}/", f"ts_{site}={token}; Path=/")

    # -- shop -----------------------------------------------------------------------------
    def _shop_get(self, w: dict, user: str | None, path: str, q: dict, form: dict) -> None:
        wd: World = w["world"]
        st = w["state"]
        p = lambda title, body: self._send(200, _page(title, "shop", user, body))  # noqa: E731
        if path == "/":
            cats = "".join(f'<li><a href="/shop/catalogue?cat={quote(c)}">{c}</a></li>' for c in CATEGORIES)
            search = f'<form method="get" action="/shop/catalogue">{_input("q", "Search products")}<button type="submit">Search</button></form>'
            return p("Shop", f"{search}<h2>Categories</h2><ul>{cats}</ul>")
        if path == "/catalogue":
            items = list(wd.products)
            base = "/shop/catalogue"
            if q.get("cat"):
                items = [x for x in items if x.category == q["cat"]]
                base += f"?cat={quote(q['cat'])}"
            if q.get("q"):
                needle = q["q"].strip().lower()
                items = [x for x in items if needle in x.name.lower()]
                base += ("&" if "?" in base else "?") + f"q={quote(q['q'])}"
            n_pages = max(1, -(-len(items) // PAGE_SIZE))
            page = min(max(1, int(q.get("page", "1"))), n_pages)
            rows = "".join(f'<tr><td><a href="/shop/product/{x.id}">{e(x.name)}</a></td><td>{x.category}</td><td>{x.price}</td></tr>'
                           for x in items[(page - 1) * PAGE_SIZE: page * PAGE_SIZE])
            return p("Catalogue", f"<p>{len(items)} products</p><table><tr><th>Product</th><th>Category</th><th>Price</th></tr>{rows}</table>"
                     + _pager(base, page, n_pages))
        if path.startswith("/product/"):
            x = wd.products[int(path.rsplit("/", 1)[1])]
            fields = f'<input type="hidden" name="product" value="{x.id}">' + _input("qty", "Quantity")
            return p(x.name, f"<p>Price: {x.price}</p><p>Category: {x.category}</p><p>In stock: {st['stock'][str(x.id)]}</p>"
                     f"<p>{e(x.description)}</p>" + _form("/shop/cart/add", fields, "Add to cart"))
        if path == "/cart":
            cart = st["carts"].get(user or "", [])
            rows = "".join(f"<tr><td>{e(wd.products[pid].name)}</td><td>{n}</td></tr>" for pid, n in cart)
            body = f"<table><tr><th>Product</th><th>Quantity</th></tr>{rows}</table>" if cart else "<p>Your cart is empty.</p>"
            return p("Cart", body + (_form("/shop/checkout", "", "Place order") if cart else ""))
        if path == "/orders":
            if not user:
                return self._redirect("/shop/login")
            rows = "".join(f"<tr><td>Order #{o['id']}</td><td>{e(', '.join(f'{n} x {wd.products[i].name}' for i, n in o['items']))}</td></tr>"
                           for o in st["orders"] if o["user"] == user)
            return p("My orders", f"<table><tr><th>Order</th><th>Items</th></tr>{rows}</table>")
        if path == "/admin":
            if user != wd.admin.name:
                return p("Admin", "<p role=alert>Only the administrator may see this page.</p>" + _login_form("shop"))
            rows = "".join(f"<tr><td>Order #{o['id']}</td><td>{e(o['user'])}</td><td>{sum(n for _, n in o['items'])}</td></tr>"
                           for o in st["orders"])
            return p("Admin", f"<h2>All orders</h2><table><tr><th>Order</th><th>Customer</th><th>Units</th></tr>{rows}</table>")
        if path == "/login":
            return p("Log in", _login_form("shop"))
        return self._send(404, _page("Not found", "shop", user, "<p>No such page.</p>"))

    def _shop_post(self, w: dict, user: str | None, path: str, q: dict, form: dict) -> None:
        st = w["state"]
        if path == "/login":
            return self._login(w, "shop", form)
        if not user:
            return self._redirect("/shop/login")
        if path == "/cart/add":
            pid = int(form["product"])
            w["world"].products[pid]  # noqa: B018  (IndexError -> 400)
            qty = int(form.get("qty") or "1")
            if not 1 <= qty <= 99:
                raise ValueError("quantity must be between 1 and 99")
            st["carts"].setdefault(user, []).append([pid, qty])
            return self._redirect("/shop/cart")
        if path == "/checkout":
            cart = st["carts"].pop(user, [])
            if cart:
                st["orders"].append({"id": len(st["orders"]) + 1, "user": user, "items": cart})
            return self._redirect("/shop/orders")
        return self._send(404, _page("Not found", "shop", user, "<p>No such page.</p>"))

    # -- forum ----------------------------------------------------------------------------
    def _forum_get(self, w: dict, user: str | None, path: str, q: dict, form: dict) -> None:
        st = w["state"]
        p = lambda title, body: self._send(200, _page(title, "forum", user, body))  # noqa: E731

        def listing(posts: list[dict], base: str) -> str:
            n_pages = max(1, -(-len(posts) // PAGE_SIZE))
            page = min(max(1, int(q.get("page", "1"))), n_pages)
            rows = "".join(f'<tr><td><a href="/forum/post/{x["id"]}">{e(x["title"])}</a></td>'
                           f'<td><a href="/forum/user/{x["author"]}">{e(x["author"])}</a></td><td>{x["score"]}</td></tr>'
                           for x in posts[(page - 1) * PAGE_SIZE: page * PAGE_SIZE])
            return (f"<table><tr><th>Title</th><th>Author</th><th>Score</th></tr>{rows}</table>" + _pager(base, page, n_pages))

        if path == "/":
            items = "".join(f'<li><a href="/forum/f/{f}">{f}</a></li>' for f in FORUMS)
            return p("Forums", f"<ul>{items}</ul>")
        if path.startswith("/f/"):
            name = path.split("/")[2]
            if name not in FORUMS:
                raise ValueError(f"no forum {name!r}")
            return p(f"Forum: {name}", listing([x for x in reversed(st["posts"]) if x["forum"] == name], f"/forum/f/{name}"))
        if path.startswith("/user/"):
            name = path.split("/")[2]
            return p(f"User {name}", listing([x for x in reversed(st["posts"]) if x["author"] == name], f"/forum/user/{name}"))
        if path.startswith("/post/"):
            x = st["posts"][int(path.split("/")[2])]
            comments = "".join(f"<li>{e(c['author'])}: {e(c['text'])}</li>" for c in st["comments"] if c["post"] == x["id"])
            votes = (_form(f"/forum/post/{x['id']}/vote?dir=up", "", "Upvote") + _form(f"/forum/post/{x['id']}/vote?dir=down", "", "Downvote"))
            return p(x["title"], f'<p>Forum: <a href="/forum/f/{x["forum"]}">{x["forum"]}</a></p><p>Author: '
                     f'<a href="/forum/user/{x["author"]}">{e(x["author"])}</a></p><p>Score: {x["score"]}</p><p>{e(x["body"])}</p>'
                     f"{votes}<h2>Comments</h2><ul>{comments}</ul>" + _form(f"/forum/post/{x['id']}/comment", _input("text", "Comment"), "Post comment"))
        if path == "/submit":
            if not user:
                return self._redirect("/forum/login")
            return p("Submit a new post", _form("/forum/submit", _input("forum", "Forum") + _input("title", "Title") + _input("body", "Body"), "Create post"))
        if path == "/login":
            return p("Log in", _login_form("forum"))
        return self._send(404, _page("Not found", "forum", user, "<p>No such page.</p>"))

    def _forum_post(self, w: dict, user: str | None, path: str, q: dict, form: dict) -> None:
        st = w["state"]
        if path == "/login":
            return self._login(w, "forum", form)
        if not user:
            return self._redirect("/forum/login")
        if path == "/submit":
            forum, title = form.get("forum", "").strip(), form.get("title", "").strip()
            if forum not in FORUMS or not title:
                return self._send(200, _page("Submit a new post", "forum", user,
                                             f"<p role=alert>Choose one of the forums {', '.join(FORUMS)} and give a title.</p>"))
            pid = len(st["posts"])
            st["posts"].append({"id": pid, "forum": forum, "title": title[:200], "author": user, "body": form.get("body", "")[:2000], "score": 1})
            return self._redirect(f"/forum/post/{pid}")
        parts = path.split("/")
        if len(parts) == 4 and parts[1] == "post":
            x = st["posts"][int(parts[2])]
            if parts[3] == "vote":
                d = 1 if q.get("dir") == "up" else -1
                st["votes"] = [v for v in st["votes"] if not (v["post"] == x["id"] and v["user"] == user)]
                st["votes"].append({"post": x["id"], "user": user, "dir": d})
                x["score"] += d
            elif parts[3] == "comment" and form.get("text", "").strip():
                st["comments"].append({"post": x["id"], "author": user, "text": form["text"][:2000]})
            return self._redirect(f"/forum/post/{x['id']}")
        return self._send(404, _page("Not found", "forum", user, "<p>No such page.</p>"))


    # -- code hosting ---------------------------------------------------------------------
    def _code_get(self, w: dict, user: str | None, path: str, q: dict, form: dict) -> None:
        wd: World = w["world"]
        st = w["state"]
        p = lambda title, body: self._send(200, _page(title, "code", user, body))  # noqa: E731

        def paged(rows: list[str], base: str, head: str) -> str:
            n_pages = max(1, -(-len(rows) // PAGE_SIZE))
            page = min(max(1, int(q.get("page", "1"))), n_pages)
            return f"<table>{head}{''.join(rows[(page - 1) * PAGE_SIZE: page * PAGE_SIZE])}</table>" + _pager(base, page, n_pages)

        def issue_rows(items: list[dict]) -> list[str]:
            return [f'<tr><td><a href="/code/issue/{i["id"]}">{e(i["title"])}</a></td><td>{e(i["author"])}</td>'
                    f'<td>{"open" if i["open"] else "closed"}</td></tr>' for i in items]

        head = "<tr><th>Issue</th><th>Author</th><th>Status</th></tr>"
        if path == "/":
            rows = [f'<tr><td><a href="/code/p/{x}">{x}</a></td><td>{sum(1 for i in st["issues"] if i["project"] == x and i["open"])}</td></tr>'
                    for x in wd.projects]
            return p("Projects", paged(rows, "/code/", "<tr><th>Project</th><th>Open issues</th></tr>"))
        if path.startswith("/p/"):
            name = path.split("/")[2]
            if name not in wd.projects:
                raise ValueError(f"no project {name!r}")
            state = q.get("state", "open")
            items = [i for i in st["issues"] if i["project"] == name and i["open"] == (state == "open")]
            n_open = sum(1 for i in st["issues"] if i["project"] == name and i["open"])
            n_closed = sum(1 for i in st["issues"] if i["project"] == name and not i["open"])
            links = f'<a href="/code/p/{name}?state=open">Open issues</a> <a href="/code/p/{name}?state=closed">Closed issues</a>'
            return p(f"Project {name}", f"<p>{n_open} open issues, {n_closed} closed issues</p><div>{links}</div>"
                     + paged(issue_rows(items), f"/code/p/{name}?state={state}", head))
        if path.startswith("/issue/"):
            i = st["issues"][int(path.split("/")[2])]
            action = _form(f"/code/issue/{i['id']}/{'close' if i['open'] else 'reopen'}", "", "Close issue" if i["open"] else "Reopen issue")
            return p(i["title"], f'<p>Project: <a href="/code/p/{i["project"]}">{i["project"]}</a></p><p>Author: {e(i["author"])}</p>'
                     f'<p>Status: {"open" if i["open"] else "closed"}</p><p>{e(i["body"])}</p>{action}')
        if path == "/search":
            needle = q.get("q", "").strip().lower()
            items = [i for i in st["issues"] if needle and needle in i["title"].lower()]
            return p("Search results", f"<p>{len(items)} issues found</p>" + paged(issue_rows(items), f"/code/search?q={quote(q.get('q', ''))}", head))
        if path == "/login":
            return p("Log in", _login_form("code"))
        return self._send(404, _page("Not found", "code", user, "<p>No such page.</p>"))

    def _code_post(self, w: dict, user: str | None, path: str, q: dict, form: dict) -> None:
        st = w["state"]
        if path == "/login":
            return self._login(w, "code", form)
        if not user:
            return self._redirect("/code/login")
        parts = path.split("/")
        if len(parts) == 4 and parts[1] == "issue" and parts[3] in ("close", "reopen"):
            i = st["issues"][int(parts[2])]
            i["open"] = parts[3] == "reopen"
            st.setdefault("issue_events", []).append({"issue": i["id"], "user": user, "open": i["open"]})
            return self._redirect(f"/code/issue/{i['id']}")
        return self._send(404, _page("Not found", "code", user, "<p>No such page.</p>"))


def _login_form(site: str) -> str:
    return _form(f"/{site}/login", _input("username", "Username") + _input("password", "Password", "password"), "Log in")


class SiteServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, token: str) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.token = token
        self.worlds = Worlds()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="serve the seeded local web sites of env=web")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    args = ap.parse_args(argv)
    token = os.environ.get("TS_WEB_TOKEN", "")
    if not token:
        print("TS_WEB_TOKEN must be set (the control secret)", file=sys.stderr)
        return 2
    srv = SiteServer(args.port, token)
    threading.Thread(target=srv.serve_forever, name="sites", daemon=True).start()
    print(f"PORT {srv.server_address[1]}", flush=True)
    while True:  # bounded by the parent's life
        time.sleep(0.5)
        if args.parent_pid and os.getppid() != args.parent_pid:
            srv.shutdown()
            return 0


if __name__ == "__main__":
    sys.exit(main())
