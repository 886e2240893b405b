"""Tasks of ``env=web``: generated per (world seed, template), with WebArena's evaluator kinds and
an oracle plan.  Pure: no I/O (the env fetches the URL / state the evaluators read).

Task ids (``data_idx``): ``seed = data_idx // TASKS_PER_SEED`` picks the world
(``envhub.web_data.world(seed)``), ``template = TEMPLATES[data_idx % len(TEMPLATES)]``, and a
private ``random.Random`` seeded with ``"<seed>:<data_idx>"`` the task's parameters, so a task id
means the same task in every process.  AgentGym-style item ids are ``web_<data_idx>``; the
default splits (``conf/env/web.yaml``) hold out whole world seeds (train ``0:4000`` = seeds 0-99,
test ``4000:4400`` = seeds 100-109); ``template_of(data_idx)`` lets a split hold out templates.

Evaluators (``Evaluator.kind``), WebArena's programmatic kinds:

- ``exact``: the ``stop`` answer equals ``expected`` (case and surrounding space aside);
- ``must_include``: the answer contains every string of ``expected``;
- ``url_match``: the final page's path equals ``path`` and its query holds ``query``;
- ``order_placed``: a new order of ``user`` holds exactly the items ``items`` (state check);
- ``post_created``: a new post by ``user`` in ``forum`` has the title ``title`` (state check);
- ``voted``: ``user`` voted ``dir`` on post ``post`` (state check);
- ``issue_closed``: issue ``issue`` is closed and ``user`` closed it (state check).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from turnscale.envhub.web_data import CATEGORIES, N_POSTS, PAGE_SIZE, World, world

TASKS_PER_SEED = 40
TEMPLATES = ("shop_price", "shop_order", "shop_category_page", "shop_admin_order_owner",
             "forum_author", "forum_create_post", "forum_upvote", "forum_user_page",
             "code_open_issue_count", "code_close_issue")


@dataclass(frozen=True)
class Evaluator:
    kind: str
    """One of the kinds in the module docstring."""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WebTask:
    idx: int
    seed: int
    template: str
    site: str
    """``shop``, ``forum`` or ``code``: the site the episode starts on."""
    objective: str
    start_path: str
    evaluator: Evaluator
    plan: tuple[tuple, ...]
    """Oracle steps (``envhub.web_oracle``)."""


def template_of(data_idx: int) -> str:
    return TEMPLATES[data_idx % len(TEMPLATES)]


def _find_post(w: World, rng: random.Random) -> Any:
    return w.posts[rng.randrange(N_POSTS)]


def _login(user: str, password: str) -> tuple[tuple, ...]:
    return (("click", "link", "Log in"), ("type", "textbox", "Username", user, False),
            ("type", "textbox", "Password", password, True))


def task(data_idx: int) -> WebTask:
    """The task of ``data_idx`` (deterministic)."""
    if data_idx < 0:
        raise ValueError(f"task index must be >= 0, got {data_idx}")
    seed, tpl = data_idx // TASKS_PER_SEED, template_of(data_idx)
    w = world(seed)
    rng = random.Random(f"{seed}:{data_idx}")
    T = lambda site, obj, start, ev, plan: WebTask(data_idx, seed, tpl, site, obj, start, ev, tuple(plan))  # noqa: E731
    if tpl == "shop_price":
        p = w.products[rng.randrange(len(w.products))]
        return T("shop", f"What is the price of the product '{p.name}' in the shop? Answer with the price as the shop shows it, e.g. $1.23.",
                 "/shop/", Evaluator("exact", {"expected": p.price}),
                 [("type", "textbox", "Search products", p.name, True), ("click", "link", p.name), ("read_stop", r"StaticText 'Price: (\$[0-9.]+)'")])
    if tpl == "shop_order":
        p = w.products[rng.randrange(len(w.products))]
        u = w.customers[rng.randrange(len(w.customers))]
        n = rng.randrange(1, 5)
        return T("shop", f"Log in to the shop as {u.name} (password {u.password}) and place an order for {n} of '{p.name}'.",
                 "/shop/", Evaluator("order_placed", {"user": u.name, "items": [[p.id, n]], "initial_orders": len(w.orders)}),
                 [*_login(u.name, u.password), ("type", "textbox", "Search products", p.name, True), ("click", "link", p.name),
                  ("type", "textbox", "Quantity", str(n), False), ("click", "button", "Add to cart"), ("click", "button", "Place order"),
                  ("stop", "")])
    if tpl == "shop_category_page":
        cat = CATEGORIES[rng.randrange(len(CATEGORIES))]
        n_pages = -(-sum(1 for p in w.products if p.category == cat) // PAGE_SIZE)
        page = rng.randrange(2, max(3, n_pages + 1)) if n_pages >= 2 else 1
        return T("shop", f"Open page {page} of the '{cat}' category in the shop's catalogue.", "/shop/",
                 Evaluator("url_match", {"path": "/shop/catalogue", "query": {"cat": cat, **({"page": str(page)} if page > 1 else {})}}),
                 [("click", "link", cat), *[("click", "link", "Next page")] * (page - 1), ("stop", "")])
    if tpl == "shop_admin_order_owner":
        k = rng.randrange(len(w.orders))
        return T("shop", f"Log in to the shop as the administrator ({w.admin.name}, password {w.admin.password}) and find which "
                 f"customer placed order #{k + 1}. Answer with the customer's user name.", "/shop/",
                 Evaluator("must_include", {"expected": [w.orders[k][0]]}),
                 [*_login(w.admin.name, w.admin.password), ("click", "link", "Admin"),
                  ("read_stop", rf"cell 'Order #{k + 1}'\n\s*\[-?\d+\] cell '([^']+)'")])
    if tpl == "code_open_issue_count":
        proj = w.projects[rng.randrange(len(w.projects))]
        n = sum(1 for i in w.issues if i.project == proj and i.open)
        return T("code", f"How many open issues does the project '{proj}' have on the code site? Answer with a number.", "/code/",
                 Evaluator("exact", {"expected": str(n)}),
                 [("find_click", "link", proj), ("read_stop", r"StaticText '(\d+) open issues, ")])
    if tpl == "code_close_issue":
        issue = rng.choice([i for i in w.issues if i.open])
        dev = w.developers[rng.randrange(len(w.developers))]
        return T("code", f"Log in to the code site as {dev.name} (password {dev.password}) and close the issue titled "
                 f"'{issue.title}' of the project '{issue.project}'.", "/code/",
                 Evaluator("issue_closed", {"user": dev.name, "issue": issue.id}),
                 [*_login(dev.name, dev.password), ("type", "textbox", "Search issues", issue.title, True), ("click", "link", issue.title),
                  ("click", "button", "Close issue"), ("stop", "")])
    post = _find_post(w, rng)
    find = [("click", "link", post.forum), ("find_click", "link", post.title)]
    if tpl == "forum_author":
        return T("forum", f"Who wrote the post titled '{post.title}' in the {post.forum} forum? Answer with the user name.", "/forum/",
                 Evaluator("exact", {"expected": post.author}),
                 [*find, ("read_stop", r"StaticText 'Author: ?'\n\s*\[-?\d+\] link '([^']+)'")])
    u = w.forum_users[rng.randrange(len(w.forum_users))]
    if tpl == "forum_create_post":
        forum = post.forum
        title = f"{rng.choice(('Notes on', 'Asking about', 'Sharing'))} {rng.choice(('spring', 'winter', 'my first', 'a cheap'))} project {rng.randrange(100, 999)}"
        return T("forum", f"Log in to the forum as {u.name} (password {u.password}) and create a post in the {forum} forum titled '{title}'.",
                 "/forum/", Evaluator("post_created", {"user": u.name, "forum": forum, "title": title, "initial_posts": N_POSTS}),
                 [*_login(u.name, u.password), ("click", "link", "Submit a new post"), ("type", "textbox", "Forum", forum, False),
                  ("type", "textbox", "Title", title, False), ("type", "textbox", "Body", "Hello everyone.", False),
                  ("click", "button", "Create post"), ("stop", "")])
    if tpl == "forum_upvote":
        return T("forum", f"Log in to the forum as {u.name} (password {u.password}) and upvote the post titled '{post.title}' in the {post.forum} forum.",
                 "/forum/", Evaluator("voted", {"user": u.name, "post": post.id, "dir": 1}),
                 [*_login(u.name, u.password), *find, ("click", "button", "Upvote"), ("stop", "")])
    return T("forum", f"Open the user page of the author of the post titled '{post.title}' in the {post.forum} forum.", "/forum/",
             Evaluator("url_match", {"path": f"/forum/user/{post.author}", "query": {}}),
             [*find, ("read_click", "link", r"StaticText 'Author: ?'\n\s*\[-?\d+\] link '([^']+)'"), ("stop", "")])


def _norm(s: str) -> str:
    return " ".join(s.strip().lower().split())


def evaluate(ev: Evaluator, *, answer: str, url: str, state: dict | None) -> bool:
    """Whether the episode that ended with ``answer`` on page ``url`` (and left the sites in
    ``state``, ``None`` when not needed) solved the task."""
    p = ev.params
    if ev.kind == "exact":
        return _norm(answer) == _norm(p["expected"])
    if ev.kind == "must_include":
        return all(_norm(x) in _norm(answer) for x in p["expected"])
    if ev.kind == "url_match":
        u = urlsplit(url)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        return u.path in (p["path"], quote(p["path"])) and all(q.get(k) == v for k, v in p["query"].items())
    if state is None:
        raise ValueError(f"evaluator {ev.kind!r} needs the sites' state")
    if ev.kind == "order_placed":
        return any(o["user"] == p["user"] and sorted(map(list, o["items"])) == sorted(p["items"])
                   for o in state["orders"][p["initial_orders"]:])
    if ev.kind == "post_created":
        return any(x["author"] == p["user"] and x["forum"] == p["forum"] and x["title"] == p["title"]
                   for x in state["posts"][p["initial_posts"]:])
    if ev.kind == "voted":
        return any(v["post"] == p["post"] and v["user"] == p["user"] and v["dir"] == p["dir"] for v in state["votes"])
    if ev.kind == "issue_closed":
        issue = state["issues"][p["issue"]]
        last = [x for x in state.get("issue_events", []) if x["issue"] == p["issue"]]
        return not issue["open"] and bool(last) and last[-1] == {"issue": p["issue"], "user": p["user"], "open": False}
    raise ValueError(f"unknown evaluator kind {ev.kind!r}")


def needs_state(ev: Evaluator) -> bool:
    return ev.kind in ("order_placed", "post_created", "voted", "issue_closed")


HELD_OUT_TEMPLATES = ("forum_user_page", "code_close_issue")
"""Templates the template split keeps out of training (one per site kind that has two or more)."""
TRAIN_SEEDS = range(0, 100)
TEST_SEEDS = range(100, 110)


def split_ids(seeds: range, templates: tuple[str, ...]) -> list[int]:
    """Task ids of ``templates`` on the world seeds ``seeds``, in id order."""
    unknown = sorted(set(templates) - set(TEMPLATES))
    if unknown:
        raise ValueError(f"unknown web task templates {unknown}; known: {list(TEMPLATES)}")
    return [s * TASKS_PER_SEED + k for s in seeds for k in range(TASKS_PER_SEED) if template_of(k) in templates]


def id_files(held_out: tuple[str, ...] = HELD_OUT_TEMPLATES) -> dict[str, list[dict[str, str]]]:
    """AgentGym-style id files (``[{"item_id": "web_<N>"}, ...]``, read by ``conf.tasks``) of the
    splits by seed and by template: ``train`` (train seeds, templates not held out),
    ``test_seen_templates`` (held-out seeds, the same templates), ``test_unseen_templates``
    (held-out seeds, the held-out templates)."""
    seen = tuple(t for t in TEMPLATES if t not in held_out)
    items = lambda ids: [{"item_id": f"web_{i}"} for i in ids]  # noqa: E731
    return {"train": items(split_ids(TRAIN_SEEDS, seen)),
            "test_seen_templates": items(split_ids(TEST_SEEDS, seen)),
            "test_unseen_templates": items(split_ids(TEST_SEEDS, tuple(held_out)))}


def main(argv: list[str] | None = None) -> int:
    """``python -m turnscale.envhub.web_tasks OUT_DIR``: write the id files of ``id_files()`` there."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description="write env=web's train/test id files (splits by seed and by template)")
    ap.add_argument("out_dir")
    ap.add_argument("--held-out", default=",".join(HELD_OUT_TEMPLATES), help="comma-separated templates kept out of training")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, items in id_files(tuple(x for x in args.held_out.split(",") if x)).items():
        path = os.path.join(args.out_dir, f"{name}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(items, f)
        print(f"{path}: {len(items)} tasks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
