"""SearchQA: tags, exact-match reward, wrong answers end the episode, BM25 finds the gold doc."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from turnscale.conf.schema import EnvConfig
from turnscale.envhub import searchqa_data
from turnscale.envhub.retrieval import BM25Retriever, Doc, load_corpus, passages
from turnscale.envhub.searchqa import INVALID, RIGHT, SearchQAFamily, exact_match, load_questions, make_family, normalize_answer

pytest.importorskip("bm25s")


@pytest.fixture(scope="module")
def family() -> SearchQAFamily:
    return make_family(EnvConfig(name="searchqa"))


@pytest.fixture(scope="module")
def questions() -> list[dict]:
    with open(os.path.join(searchqa_data.DATA_DIR, searchqa_data.QUESTIONS_FILE)) as f:
        return [json.loads(line) for line in f]


def test_shipped_files_are_what_the_generator_writes(tmp_path):
    searchqa_data.write(str(tmp_path))
    for name in (searchqa_data.CORPUS_FILE, searchqa_data.QUESTIONS_FILE):
        with open(tmp_path / name, "rb") as a, open(os.path.join(searchqa_data.DATA_DIR, name), "rb") as b:
            assert a.read() == b.read(), name


def test_normalisation_drops_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The  Eiffel-Tower! ") == "eiffeltower"
    assert normalize_answer("An apple a day") == "apple day"
    assert exact_match("the Beijing.", ["Beijing"]) and not exact_match("Beijing China", ["Beijing"])


def test_gold_answer_gets_reward_one_and_ends(family, questions):
    env = family.create()
    for idx in (0, 1, 2, 850):
        r = env.reset(idx)
        assert r.info["category"] == questions[idx]["data_source"]
        assert r.observation.endswith(f"Question: {questions[idx]['question']}")
        s = env.step(f"<think>sure</think>\n<answer> {questions[idx]['golden_answers'][0].upper()} </answer>")
        assert (s.observation, s.reward, s.done, s.info["success"]) == (RIGHT, 1.0, True, True)


def test_wrong_answer_gets_zero_and_ends_the_episode(family):
    env = family.create()
    env.reset(5)
    s = env.step("<answer>Atlantis</answer>")
    assert (s.reward, s.done, s.info["success"]) == (0.0, True, False)
    assert "incorrect" in s.observation


def test_last_answer_tag_is_graded(family, questions):
    env = family.create()
    env.reset(3)
    s = env.step(f"<answer>x</answer> no wait <answer>{questions[3]['golden_answers'][0]}</answer>")
    assert s.reward == 1.0


def test_text_without_tags_explains_the_format(family):
    env = family.create()
    env.reset(0)
    for bad in ("I think it is Paris", "<search>unterminated", "<answer></search>"):
        s = env.step(bad)
        assert (s.observation, s.reward, s.done) == (INVALID, 0.0, False)


def test_search_returns_information_with_top_k_docs(family, questions):
    env = family.create()
    env.reset(2)
    s = env.step(f"<think>hm</think><search> {questions[2]['question']} </search>")
    assert s.observation.startswith("<information>Doc 1(Title: ") and s.observation.endswith("</information>")
    assert s.observation.count("\nDoc ") == 2 and not s.done and s.reward == 0.0
    assert env.step("<search>  </search>").observation.startswith("Your search query is empty")


def test_gold_doc_is_in_top_3_for_most_questions(family, questions):
    rows = family.retriever.search([q["question"] for q in questions], 3)
    hits = sum(q["gold_docs"][0] in {d.id for d in r} for q, r in zip(questions, rows))
    assert hits / len(questions) >= 0.9


def test_second_hop_doc_is_found_from_the_first_docs_text(family, questions):
    """A two-hop question is answerable: the bridge entity named in doc 1 retrieves doc 2."""
    two = [q for q in questions if q["data_source"] == "synth_2hop"][:50]
    docs = {d.id: d for d in family.retriever.docs}
    found = 0
    for q in two:
        bridge = docs[q["gold_docs"][1]].title.strip('"')
        assert bridge in docs[q["gold_docs"][0]].text
        found += q["gold_docs"][1] in {d.id for d in family.retriever.search([bridge], 3)[0]}
    assert found / len(two) >= 0.9


def test_passages_render_as_agentgym():
    docs = [Doc("1", '"A"\nalpha text'), Doc("2", '"B"\nbeta')]
    assert passages(docs) == 'Doc 1(Title: "A") alpha text\nDoc 2(Title: "B") beta'


def test_custom_jsonl_and_parquet_questions(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\nfact number {i} zebra{i}'}) + "\n" for i in range(20)))
    qj = tmp_path / "nq.jsonl"
    qj.write_text(json.dumps({"id": "q0", "question": "Which zebra7?", "golden_answers": ["seven"]}) + "\n")
    qp = tmp_path / "hotpot.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"question": "Q?", "reward_model": {"ground_truth": {"target": ["yes"]}}, "data_source": "hotpotqa"},
    ]), qp)
    fam = make_family(EnvConfig(name="searchqa", options={"corpus": str(corpus), "questions": [str(qj), str(qp)], "top_k": 2}))
    env = fam.create()
    assert fam.num_tasks() == 2
    assert env.reset(0).info["category"] == "nq" and env.reset(1).info["category"] == "hotpotqa"
    assert env.step("<answer>Yes</answer>").reward == 1.0
    env.reset(0)
    assert 'Doc 1(Title: "T7") fact number 7 zebra7' in env.step("<search>zebra7</search>").observation


def test_bad_inputs_are_rejected_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="retriever"):
        make_family(EnvConfig(name="searchqa", options={"retriever": "faiss"}))
    with pytest.raises(ValueError, match="topk"):
        make_family(EnvConfig(name="searchqa", options={"topk": 3}))
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question": "no answers"}) + "\n")
    with pytest.raises(ValueError, match="golden_answers"):
        load_questions([str(bad)])
    bad.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="corpus record"):
        load_corpus(str(bad))


def test_bm25_empty_query_returns_nothing():
    r = BM25Retriever([Doc("0", '"a"\nhello world'), Doc("1", '"b"\nfoo')])
    assert r.search(["", "the of"], 3) == [[], []]
    assert [d.id for d in r.search(["hello"], 5)[0]] == ["0"]


@given(st.text(max_size=120) | st.builds(lambda t, x: f"<{t}>{x}</{t}>", st.sampled_from(["search", "answer", "x"]), st.text(max_size=60)))
@settings(max_examples=200, deadline=None)
def test_any_reply_is_a_normal_step(family, reply):
    env = family.create()
    env.reset(11)
    s = env.step(reply)
    assert s.observation and s.reward in (0.0, 1.0) and s.done == s.observation.startswith(("Congratulations", "Sorry"))


def test_concurrent_searches_match_sequential_ones(family):
    from concurrent.futures import ThreadPoolExecutor

    qs = [it.question for it in family.items[:200]]
    seq = [[d.id for d in family.retriever.search([q], 3)[0]] for q in qs]
    with ThreadPoolExecutor(8) as ex:
        par = list(ex.map(lambda q: [d.id for d in family.retriever.search([q], 3)[0]], qs))
    assert par == seq


_OLD_ACTION = __import__("re").compile(r"<(search|answer)>(.*?)</\1>", __import__("re").DOTALL)
_OLD_ANSWER = __import__("re").compile(r"<answer>(.*?)</answer>", __import__("re").DOTALL)
_PIECES = st.sampled_from(["<search>", "</search>", "<answer>", "</answer>", "<search", "answer>", "q", " ", "\n", "<", "/"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_PIECES, max_size=14).map("".join))
def test_linear_tag_parsing_agrees_with_the_reference_regex(text):
    from turnscale.envhub.searchqa import first_action, last_answer

    m = _OLD_ACTION.search(text)
    assert first_action(text) == (None if m is None else (m.group(1), m.group(2)))
    found = _OLD_ANSWER.findall(text)
    assert last_answer(text) == (found[-1] if found else None)


def test_tag_parsing_reads_each_character_a_bounded_number_of_times():
    """Counted, not timed: every ``str.find``/``rfind``/regex step of the parser is linear, so
    the work on an unclosed-tag bomb grows with its length (the regex rescanned to the end
    from every opening tag)."""
    import re

    from turnscale.envhub import searchqa

    scanned = []

    class Counting(str):
        def find(self, sub, start=0, *args):
            at = str.find(self, sub, start, *args)
            scanned.append((len(self) if at < 0 else at + len(sub)) - start)
            return at

        def rfind(self, sub, *args):
            scanned.append(len(self))
            return str.rfind(self, sub, *args)

    for n in (1000, 8000):
        scanned.clear()
        bomb = Counting("<answer>x</answer>" + "<answer>" * n)
        searchqa.first_action(bomb)
        searchqa.last_answer(bomb)
        assert sum(scanned) <= 6 * len(bomb), (n, sum(scanned))
    assert isinstance(searchqa._OPEN, re.Pattern) and "?" not in searchqa._OPEN.pattern  # the only regex: no lazy/backtracking part


def test_wrong_answer_retry_keeps_the_episode_open_as_agentgym(family, questions):
    retry = SearchQAFamily(family.retriever, family.items, wrong_answer="retry").create()
    retry.reset(5)
    s = retry.step("<answer>Atlantis</answer>")
    assert (s.reward, s.done, s.observation) == (0.0, False, "Sorry, your answer is incorrect. Please try again.")
    s = retry.step(f"<answer>{questions[5]['golden_answers'][0]}</answer>")
    assert (s.reward, s.done, s.info["success"]) == (1.0, True, True)
    with pytest.raises(ValueError, match="wrong_answer"):
        SearchQAFamily(family.retriever, family.items, wrong_answer="maybe")


def test_first_observation_is_agentgyms_prompt_with_the_question_stripped(family):
    env = family.create()
    item = family.items[3]
    obs = env.reset(3).observation
    assert obs.startswith("You must reason inside <think>...</think> first.") and obs.endswith(f"\n\n Question: {item.question.strip()}")
