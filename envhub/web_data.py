"""Seeded content of the local web sites (``env=web``): a shop, a forum and a code-hosting site
(projects and their issues), generated from one
integer seed.  Pure: no I/O, no global RNG.

Invariants:

- ``world(seed)`` is a pure function of ``seed`` (a private ``random.Random(seed)``; fixed word
  lists; no set/dict iteration order involved): the same seed gives byte-identical content in
  every process, which is what lets the env process (tasks, evaluators) and the site server
  (pages) agree on ids, names and answers without talking.
- Names that tasks refer to are unique within a world (product names, post titles, user names).
- ``World.initial_state()`` returns a fresh, deep-copied mutable state (orders, carts, posts,
  comments, votes); the immutable catalogue is shared.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from functools import lru_cache

N_PRODUCTS = 320
N_CUSTOMERS = 40
N_POSTS = 420
N_FORUM_USERS = 48
N_PROJECTS = 30
N_ISSUES = 400
N_DEVELOPERS = 24
PAGE_SIZE = 20

_ADJ = ("Amber", "Brisk", "Cobalt", "Dusky", "Ember", "Frost", "Golden", "Hazel", "Ivory", "Jade",
        "Kestrel", "Lunar", "Misty", "Noble", "Onyx", "Pine", "Quartz", "Ruby", "Sable", "Tidal")
_MATERIAL = ("Steel", "Oak", "Linen", "Ceramic", "Bamboo", "Copper", "Wool", "Glass", "Leather", "Cotton")
_NOUN = ("Kettle", "Lamp", "Backpack", "Mug", "Blanket", "Chair", "Notebook", "Scarf", "Teapot",
         "Clock", "Vase", "Pillow", "Skillet", "Umbrella", "Wallet", "Candle")
CATEGORIES = ("Kitchen", "Household", "Outdoor", "Office", "Apparel", "Decor", "Travel", "Garden")
_FIRST = ("alice", "bruno", "chen", "dana", "emeka", "farah", "goran", "hana", "ivan", "jun",
          "kira", "liam", "mina", "nils", "olga", "pavel", "quinn", "rosa", "sami", "tara",
          "ugo", "vera", "wen", "xena", "yusuf", "zoe")
_LAST = ("stone", "rivers", "park", "moreau", "okafor", "silva", "novak", "tanaka", "berg", "costa")
FORUMS = ("gardening", "cooking", "cycling", "photography", "books", "travel")
_TOPIC = ("tomatoes", "sourdough", "gear ratios", "night shots", "sci-fi novels", "train passes",
          "compost", "knife skills", "tubeless tyres", "lenses", "poetry", "hostels", "seedlings",
          "spices", "commuting", "film cameras", "libraries", "packing lists")
_FRAME = ("Question about {t}", "My experience with {t}", "Tips for {t}", "Beginner help: {t}",
          "Is it worth it: {t}", "Weekly thread on {t}", "Unpopular opinion on {t}", "Best guide to {t}")
_PROJ_A = ("swift", "tiny", "open", "rusty", "quiet", "bright", "lazy", "mega", "nano", "deep")
_PROJ_B = ("parser", "cache", "router", "scheduler", "renderer", "compiler", "indexer", "crawler", "logger", "shell")
_ISSUE = ("Crash when {x}", "Slow {x}", "Docs missing for {x}", "Add support for {x}", "Wrong output from {x}",
          "Flaky test in {x}", "Memory leak in {x}", "Refactor {x}")
_THING = ("the config loader", "unicode input", "large files", "the CLI", "empty lists", "timeouts", "the REST API",
          "Windows paths", "retries", "the plugin system", "dark mode", "nested tables")
_WORDS = ("really", "think", "season", "budget", "easy", "tried", "result", "friends", "cheap",
          "quality", "weekend", "advice", "works", "first", "better", "slowly", "again", "simple")


@dataclass(frozen=True)
class Product:
    id: int
    name: str
    category: str
    price_cents: int
    stock: int
    description: str

    @property
    def price(self) -> str:
        """The price as the shop shows it (``$12.34``)."""
        return f"${self.price_cents // 100}.{self.price_cents % 100:02d}"


@dataclass(frozen=True)
class User:
    name: str
    password: str


@dataclass(frozen=True)
class Post:
    id: int
    forum: str
    title: str
    author: str
    body: str
    score: int


@dataclass(frozen=True)
class Issue:
    id: int
    project: str
    title: str
    author: str
    body: str
    open: bool


@dataclass(frozen=True)
class World:
    """All content of one seed.  ``products``/``posts`` are indexed by id (``products[i].id == i``)."""

    seed: int
    products: tuple[Product, ...]
    customers: tuple[User, ...]
    admin: User
    forum_users: tuple[User, ...]
    posts: tuple[Post, ...]
    comments: tuple[tuple[int, str, str], ...]
    """Initial comments as ``(post_id, author, text)``."""
    orders: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]
    """Initial orders as ``(customer, ((product_id, qty), ...))``."""
    projects: tuple[str, ...] = ()
    developers: tuple[User, ...] = ()
    issues: tuple[Issue, ...] = ()
    _by_name: dict = field(default_factory=dict, compare=False, repr=False)

    def initial_state(self) -> dict:
        """A fresh mutable state for one isolated copy of the sites (JSON-serialisable)."""
        return copy.deepcopy({
            "orders": [{"id": i + 1, "user": u, "items": [list(x) for x in items]} for i, (u, items) in enumerate(self.orders)],
            "carts": {},
            "stock": {str(p.id): p.stock for p in self.products},
            "posts": [{"id": p.id, "forum": p.forum, "title": p.title, "author": p.author, "body": p.body, "score": p.score}
                      for p in self.posts],
            "comments": [{"post": p, "author": a, "text": t} for p, a, t in self.comments],
            "votes": [],
            "issue_events": [],
            "issues": [{"id": i.id, "project": i.project, "title": i.title, "author": i.author, "body": i.body, "open": i.open}
                       for i in self.issues],
        })

    def product_named(self, name: str) -> Product:
        return next(p for p in self.products if p.name == name)

    def user(self, name: str) -> User:
        return next(u for u in (*self.customers, self.admin, *self.forum_users, *self.developers) if u.name == name)


def _users(rng: random.Random, n: int, tag: str) -> tuple[User, ...]:
    names: list[str] = []
    while len(names) < n:
        name = f"{rng.choice(_FIRST)}_{rng.choice(_LAST)}"
        if name not in names:
            names.append(name)
    return tuple(User(nm, f"{tag}-{rng.randrange(10**6):06d}") for nm in names)


@lru_cache(maxsize=16)
def world(seed: int) -> World:
    """The world of ``seed`` (cached; treat as immutable)."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < N_PRODUCTS:
        name = f"{rng.choice(_ADJ)} {rng.choice(_MATERIAL)} {rng.choice(_NOUN)}"
        if name not in names:
            names.append(name)
    products = tuple(
        Product(i, nm, rng.choice(CATEGORIES), rng.randrange(199, 25000), rng.randrange(0, 60),
                " ".join(rng.choice(_WORDS) for _ in range(12)))
        for i, nm in enumerate(names))
    customers = _users(rng, N_CUSTOMERS, "shop")
    admin = User("admin", f"admin-{rng.randrange(10**6):06d}")
    forum_users = _users(rng, N_FORUM_USERS, "forum")
    titles: list[str] = []
    while len(titles) < N_POSTS:
        t = rng.choice(_FRAME).format(t=rng.choice(_TOPIC)) + f" ({rng.randrange(1000, 9999)})"
        if t not in titles:
            titles.append(t)
    posts = tuple(
        Post(i, rng.choice(FORUMS), t, rng.choice(forum_users).name,
             " ".join(rng.choice(_WORDS) for _ in range(20)), rng.randrange(-5, 120))
        for i, t in enumerate(titles))
    comments = tuple((rng.randrange(N_POSTS), rng.choice(forum_users).name,
                      " ".join(rng.choice(_WORDS) for _ in range(8))) for _ in range(600))
    orders = tuple(
        (rng.choice(customers).name, tuple((rng.randrange(N_PRODUCTS), rng.randrange(1, 4)) for _ in range(rng.randrange(1, 4))))
        for _ in range(60))
    projects: list[str] = []
    while len(projects) < N_PROJECTS:
        name = f"{rng.choice(_PROJ_A)}-{rng.choice(_PROJ_B)}"
        if name not in projects:
            projects.append(name)
    developers = _users(rng, N_DEVELOPERS, "code")
    ititles: list[str] = []
    while len(ititles) < N_ISSUES:
        t = rng.choice(_ISSUE).format(x=rng.choice(_THING)) + f" #{rng.randrange(100, 999)}"
        if t not in ititles:
            ititles.append(t)
    issues = tuple(Issue(i, rng.choice(projects), t, rng.choice(developers).name,
                         " ".join(rng.choice(_WORDS) for _ in range(16)), rng.random() < 0.6)
                   for i, t in enumerate(ititles))
    return World(seed, products, customers, admin, forum_users, posts, comments, orders, tuple(projects), developers, issues)
