"""``env=web`` without a browser: seeded content, tasks, evaluators, the oracle on page text and
the observation budget (pure functions)."""

from __future__ import annotations

import pytest

from turnscale.envhub.web import token_counter, truncate_tree
from turnscale.envhub.web_data import CATEGORIES, FORUMS, N_POSTS, N_PRODUCTS, world
from turnscale.envhub.web_oracle import MAX_SCROLLS, OracleLost, WebOracle, element_id
from turnscale.envhub.web_tasks import TASKS_PER_SEED, TEMPLATES, Evaluator, evaluate, task


def test_site_content_is_a_pure_function_of_the_seed():
    a, b, c = world(7), world.__wrapped__(7), world(8)
    assert a == b and a.initial_state() == b.initial_state()
    assert a.products != c.products and a.posts != c.posts
    assert len(a.products) == N_PRODUCTS and len(a.posts) == N_POSTS
    assert len({p.name for p in a.products}) == N_PRODUCTS and len({p.title for p in a.posts}) == N_POSTS
    nav = {"Home", "Catalogue", "Cart", "My orders", "Admin", "Log in", "Forums", "Submit a new post", "Projects", "Search",
           "Next page", "Previous page"}
    names = {*CATEGORIES, *FORUMS, *a.projects, *(p.name for p in a.products), *(p.title for p in a.posts)}
    assert not names & nav  # a task's link is never confused with a navigation link
    s = a.initial_state()
    s["orders"].append({"id": 999})
    assert a.initial_state() != s  # every copy of the sites starts fresh


def test_tasks_are_deterministic_and_cover_every_template_per_seed():
    assert [task(i) for i in range(80)] == [task(i) for i in range(80)]
    assert {task(i).template for i in range(TASKS_PER_SEED)} == set(TEMPLATES)
    t = task(4000)
    assert t.seed == 100 and t.template == TEMPLATES[0] and t.objective != task(0).objective
    with pytest.raises(ValueError, match=">= 0"):
        task(-1)


@pytest.mark.parametrize("ev, good, bad", [
    (Evaluator("exact", {"expected": "$12.30"}), {"answer": " $12.30 "}, {"answer": "$12.3"}),
    (Evaluator("must_include", {"expected": ["alice_stone"]}), {"answer": "It was Alice_Stone."}, {"answer": "alice"}),
    (Evaluator("url_match", {"path": "/shop/catalogue", "query": {"cat": "Household", "page": "3"}}),
     {"url": "http://h/shop/catalogue?cat=Household&page=3"}, {"url": "http://h/shop/catalogue?cat=Household&page=2"}),
    (Evaluator("order_placed", {"user": "u", "items": [[4, 2]], "initial_orders": 1}),
     {"state": {"orders": [{"user": "u", "items": [[1, 1]]}, {"user": "u", "items": [[4, 2]]}]}},
     {"state": {"orders": [{"user": "u", "items": [[4, 2]]}, {"user": "u", "items": [[4, 1]]}]}}),
    (Evaluator("post_created", {"user": "u", "forum": "books", "title": "T", "initial_posts": 0}),
     {"state": {"posts": [{"author": "u", "forum": "books", "title": "T"}]}},
     {"state": {"posts": [{"author": "u", "forum": "travel", "title": "T"}]}}),
    (Evaluator("voted", {"user": "u", "post": 3, "dir": 1}),
     {"state": {"votes": [{"post": 3, "user": "u", "dir": 1}]}}, {"state": {"votes": [{"post": 3, "user": "u", "dir": -1}]}}),
    (Evaluator("issue_closed", {"user": "u", "issue": 0}),
     {"state": {"issues": [{"open": False}], "issue_events": [{"issue": 0, "user": "u", "open": False}]}},
     {"state": {"issues": [{"open": False}], "issue_events": [{"issue": 0, "user": "v", "open": False}]}}),
])
def test_every_evaluator_kind_passes_the_right_episode_and_fails_the_wrong_one(ev, good, bad):
    base = {"answer": "", "url": "http://h/", "state": None}
    assert evaluate(ev, **{**base, **good}) is True
    assert evaluate(ev, **{**base, **bad}) is False


def test_state_evaluators_refuse_to_judge_without_state():
    with pytest.raises(ValueError, match="needs the sites' state"):
        evaluate(Evaluator("voted", {}), answer="", url="", state=None)


PAGE = """[4] RootWebArea 'Shop' focused: True
\t[11] link 'Log in'
\t[3] textbox 'Search products' required: False
\t[20] link 'Next page'
\t[21] StaticText 'Price: $5.10'"""


def test_oracle_reads_ids_and_answers_from_the_page_text():
    assert element_id(PAGE, "link", "Log in") == 11 and element_id(PAGE, "link", "Log") is None
    o = WebOracle((("type", "textbox", "Search products", "mug", True), ("find_click", "link", "Blue Mug"),
                   ("read_stop", r"Price: (\$[0-9.]+)")))
    assert o.next_action(PAGE) == "type [3] [mug] [1]"
    assert o.next_action(PAGE) == "click [20]"  # not on this page: next page, same step
    assert o.next_action(PAGE + "\n\t[30] link 'Blue Mug'") == "click [30]"
    assert o.next_action(PAGE) == "stop [$5.10]"
    lost = WebOracle((("click", "button", "Upvote"),))
    assert [lost.next_action(PAGE) for _ in range(MAX_SCROLLS)] == ["scroll [down]"] * MAX_SCROLLS  # below the window?
    with pytest.raises(OracleLost):
        lost.next_action(PAGE)


def test_over_long_tree_is_cut_at_a_line_within_the_budget():
    tree = "\n".join(f"\t[{i}] link 'item number {i}'" for i in range(1000))
    out = truncate_tree(tree, 64)
    body, last = out.rsplit("\n", 1)
    assert len(body) <= 64 * 4 and tree.startswith(body) and last.startswith("[... ") and "more lines truncated" in last
    assert truncate_tree("short", 64) == "short"


def test_id_files_split_by_seed_and_by_template_and_parse_as_task_specs(tmp_path):
    from turnscale.conf.tasks import parse_task_spec
    from turnscale.envhub.web_tasks import HELD_OUT_TEMPLATES, main

    assert main([str(tmp_path)]) == 0
    specs = {name: parse_task_spec(str(tmp_path / f"{name}.json"), "web")
             for name in ("train", "test_seen_templates", "test_unseen_templates")}
    train = [i for i, _ in specs["train"]]
    assert specs["train"][0] == (0, "web_0") and len(train) == 100 * 32
    assert all(task(i).template not in HELD_OUT_TEMPLATES and task(i).seed < 100 for i in train[::97])
    assert {task(i).template for i, _ in specs["test_unseen_templates"]} == set(HELD_OUT_TEMPLATES)
    assert all(task(i).seed >= 100 for name in specs if name != "train" for i, _ in specs[name])
    with pytest.raises(ValueError, match="unknown web task templates"):
        main([str(tmp_path), "--held-out", "nope"])


def test_tree_budget_is_counted_with_the_tokenizer_when_one_is_given():
    tree = "\n".join(f"[{i}] link 'alphabetical-navigation-item'" for i in range(200))
    words = lambda text: len(text.split())  # a stand-in tokenizer: one token per word  # noqa: E731
    out = truncate_tree(tree, 64, count_tokens=words)
    body, last = out.rsplit("\n", 1)
    assert words(body) <= 64 and tree.startswith(body) and "more lines truncated" in last
    assert len(body) > 64 * 4  # the 4-chars estimate would have cut far earlier than the word count
    assert truncate_tree("short tree", 64, count_tokens=words) == "short tree"


def test_observation_budget_uses_a_local_tokenizer_folder_and_rejects_a_missing_one(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer
    count = token_counter(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    text = "[3] link 'Upvote' focused: True"
    assert count(text) == len(tok.encode(text, add_special_tokens=False))
    assert token_counter("") is None
    with pytest.raises(ValueError, match="env.options.tokenizer"):
        token_counter(str(tmp_path))
