"""The sites process of ``env=web`` on its own (no browser): isolated worlds, the control
secret, real state changes through forms."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest

from turnscale.envhub.web import SiteProcess
from turnscale.envhub.web_data import world


@pytest.fixture(scope="module")
def sites():
    s = SiteProcess()
    yield s
    s.close()
    assert s.proc.poll() is not None


class _Browser:
    """A minimal cookie-keeping HTTP client that follows redirects (what a browser does)."""

    def __init__(self, sites, wid: str) -> None:
        self.base, self.cookies = sites.base, {"tsworld": wid}

    def open(self, path: str, form: dict | None = None) -> tuple[int, str]:
        url, data = self.base + path, None if form is None else urllib.parse.urlencode(form).encode()
        for _ in range(5):
            headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
            req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
            try:
                resp = urllib.request.build_opener(_NoRedirect).open(req, timeout=30)
            except urllib.error.HTTPError as e:
                resp = e
            for c in resp.headers.get_all("Set-Cookie") or []:
                k, v = c.split(";")[0].split("=", 1)
                self.cookies[k] = v
            if resp.status != 303:
                return resp.status, resp.read().decode()
            url, data = self.base + resp.headers["Location"], None
        raise AssertionError("redirect loop")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_control_routes_need_the_secret_and_pages_need_a_world(sites):
    req = urllib.request.Request(sites.base + "/_control/reset", data=b'{"world": "x", "seed": 1}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(sites.base + "/shop/", timeout=30)
    assert e.value.code == 403 and b"no site world" in e.value.read()


def test_an_order_placed_through_the_forms_shows_in_that_world_only(sites):
    w = world(5)
    u, p = w.customers[0], w.products[17]
    for wid in ("wa", "wb"):
        sites.control("/_control/reset", {"world": wid, "seed": 5})
    b = _Browser(sites, "wa")
    assert "Wrong user name or password" in b.open("/shop/login", {"username": u.name, "password": "wrong"})[1]
    assert "Signed in as " + u.name in b.open("/shop/login", {"username": u.name, "password": u.password})[1]
    status, cart = b.open("/shop/cart/add", {"product": "17", "qty": "3"})
    assert status == 200 and p.name in cart and "Place order" in cart
    assert f"3 x {p.name}" in b.open("/shop/checkout", {})[1]
    a_state, b_state = (sites.control(f"/_control/state?world={x}") for x in ("wa", "wb"))
    assert a_state["orders"][-1] == {"id": len(w.orders) + 1, "user": u.name, "items": [[17, 3]]}
    assert b_state == w.initial_state()
    assert b.open("/shop/cart/add", {"product": "17", "qty": "500"})[0] == 400
    assert b.open("/shop/cart/add", {"product": "99999", "qty": "1"})[0] == 400
    assert sites.control("/_control/state?world=wa") == a_state  # refused, nothing changed
    sites.control("/_control/drop", {"world": "wa"})
    with pytest.raises(urllib.error.HTTPError) as e:
        sites.control("/_control/state?world=wa")
    assert e.value.code == 404 and b.open("/shop/")[0] == 403  # a closed instance's world is gone


def test_catalogue_is_paginated_and_searchable(sites):
    sites.control("/_control/reset", {"world": "wc", "seed": 2})
    b = _Browser(sites, "wc")
    first = b.open("/shop/catalogue")[1]
    assert "Page 1 of 16" in first and "Next page" in first
    name = world(2).products[40].name
    hit = b.open("/shop/catalogue?q=" + urllib.parse.quote(name))[1]
    assert name in hit and "Page 1 of 1" in hit
    assert json.loads(json.dumps(sites.control("/_control/state?world=wc")))["stock"]["40"] == world(2).products[40].stock


def test_closing_an_issue_needs_a_login_and_is_recorded(sites):
    w = world(3)
    dev, issue = w.developers[2], next(i for i in w.issues if i.open)
    sites.control("/_control/reset", {"world": "wd", "seed": 3})
    b = _Browser(sites, "wd")
    status, page = b.open(f"/code/issue/{issue.id}/close", {})
    assert status == 200 and "Log in" in page and sites.control("/_control/state?world=wd")["issues"][issue.id]["open"]
    b.open("/code/login", {"username": dev.name, "password": dev.password})
    assert "Status: closed" in b.open(f"/code/issue/{issue.id}/close", {})[1]
    state = sites.control("/_control/state?world=wd")
    assert state["issues"][issue.id]["open"] is False and state["issue_events"] == [{"issue": issue.id, "user": dev.name, "open": False}]
    hits = b.open("/code/search?q=" + urllib.parse.quote(issue.title))[1]
    assert "1 issues found" in hits and issue.title in hits
