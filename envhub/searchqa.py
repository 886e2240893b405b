"""SearchQA: answer a question by issuing searches, AgentGym's ``agentenv-searchqa`` protocol.

Episode: ``reset(data_idx)`` picks QA item ``data_idx % N`` (items concatenated in the order of
``options.questions``) and returns AgentGym's instruction prompt ending in ``Question: <q>``.
Each step takes the agent's raw text and acts on its *first* tag:

* ``<search>query</search>`` -> ``<information>Doc 1(Title: t) text\\nDoc 2(...)...</information>``
  with the retriever's top ``top_k`` documents; reward 0, not done.
* ``<answer>a</answer>`` (the *last* ``<answer>`` in the text is graded, as AgentGym) ->
  normalised exact match against any golden answer (lowercase; punctuation, the articles
  a/an/the and extra whitespace removed).  Right: reward 1, done.  Wrong, by default: reward 0
  and **done** — one answer is final.  *Difference from AgentGym*, which answers "Sorry, your
  answer is incorrect. Please try again." and keeps the episode open, so an agent could
  enumerate guesses; ``wrong_answer: retry`` restores AgentGym's behaviour and text.
* neither tag -> an observation explaining the format; reward 0, not done.

``info["category"]`` (reset) is the item's ``data_source`` (else the questions file's stem);
``info["success"]`` (step) is True exactly on a correct answer.  Id ranges: the shipped default
set has 1000 synthetic questions (``synth_1hop`` / ``synth_2hop``; conf uses 0-799 for training
and 800-999 for testing).  With AgentGym's files (``test.parquet`` then ``train.parquet``) the
AgentGym ranges hold (nq 0-3609, ..., train nq 51713-130880, hotpotqa 130881-221327).

Options (``env.options``):
  ``retriever``: ``bm25`` (in-process ``bm25s`` over ``corpus``) or ``http`` (Search-R1's
    ``/retrieve`` service at ``retriever_url``).  Default ``bm25``.
  ``corpus``: JSONL corpus path for ``bm25`` (``{"id", "contents"}`` lines).  Empty: the shipped
    synthetic encyclopedia (``envhub/data/searchqa/corpus.jsonl``).
  ``questions``: a JSONL or Parquet path, or a list of them, in the FlashRAG layout
    (``{"id", "question", "golden_answers": [...], "data_source"?}``; Search-R1's
    ``reward_model.ground_truth.target`` is read too).  Empty: the shipped questions.
  ``top_k``: documents per search (default 3, AgentGym's).
  ``retriever_url``: e.g. ``http://127.0.0.1:8000/retrieve`` (for ``http``).
  ``retriever_timeout_s``: HTTP timeout per search (default 30).
  ``wrong_answer``: ``end`` (default: a wrong answer ends the episode) or ``retry`` (AgentGym's:
    "Sorry, your answer is incorrect. Please try again.", the episode goes on).

AgentGym's routes (``envhub.server``, root face): ``POST /create {"id"}`` answers the bare int
instance id with task ``id`` already loaded; ``POST /reset {"env_idx", "id"}`` answers the prompt
string.  The prompt is AgentGym's byte for byte (question stripped).
"""

from __future__ import annotations

import json
import os
import re
import string
from dataclasses import dataclass
from typing import Any

from turnscale.envhub.base import AgentGymShape, ResetResult, StepResult
from turnscale.envhub.options import read_options
from turnscale.envhub.retrieval import BM25Retriever, HttpRetriever, Retriever, passages
from turnscale.envhub.searchqa_data import CORPUS_FILE, DATA_DIR, QUESTIONS_FILE

PROMPT = (
    "You must reason inside <think>...</think> first. If you do not have enough knowledge, issue a "
    "<search>...</search> and then STOP. Do not generate <information> or <answer> yet. Wait for external "
    "input wrapped in <information>...</information>. After receiving information, reason again in <think>. "
    "If confident, output your final answer in <answer>...</answer>. Do not output <answer> before receiving "
    "<information> unless you are fully confident. If you find no further external knowledge needed, you can "
    "directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Follow this process every time.\n\n Question: {question}"
)
INVALID = (
    "Your previous action is invalid. If you want to search, you should put the query between <search> and "
    "</search>. If you want to give the final answer, you should put the answer between <answer> and </answer>. "
    "Please try again."
)
RIGHT = "Congratulations! You have answered the question correctly."
WRONG = "Sorry, your answer is incorrect. The episode has ended."
WRONG_RETRY = "Sorry, your answer is incorrect. Please try again."
WRONG_ANSWER = ("end", "retry")
EMPTY_QUERY = "Your search query is empty. Put the words to search for between <search> and </search>."

_OPEN = re.compile(r"<(search|answer)>")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def first_action(text: str) -> tuple[str, str] | None:
    """``(kind, content)`` of the first ``<search>...</search>`` or ``<answer>...</answer>``
    pair — the earliest opening tag that has its closing tag somewhere after it, content up
    to the first such closing tag — or ``None``.  Same result as the regex
    ``<(search|answer)>(.*?)</\\1>`` (DOTALL) searched once, but O(len(text)): that regex
    rescans to the end from every unclosed opening tag (quadratic in the action's length)."""
    last_close = {kind: text.rfind(f"</{kind}>") for kind in ("search", "answer")}
    for m in _OPEN.finditer(text):
        kind = m.group(1)
        if last_close[kind] >= m.end():
            return kind, text[m.end():text.find(f"</{kind}>", m.end())]
    return None


def last_answer(text: str) -> str | None:
    """The content of the last of the non-overlapping ``<answer>...</answer>`` pairs read left
    to right (what ``re.findall(r"<answer>(.*?)</answer>")[-1]`` gives), in O(len(text))."""
    found, pos = None, 0
    while True:
        start = text.find("<answer>", pos)
        if start < 0:
            return found
        end = text.find("</answer>", start + 8)
        if end < 0:
            return found
        found, pos = text[start + 8:end], end + 9


def normalize_answer(s: str) -> str:
    """SQuAD/Search-R1 normalisation: lowercase, drop punctuation, articles, extra whitespace."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, golden: list[str]) -> bool:
    p = normalize_answer(prediction)
    return any(normalize_answer(g) == p for g in golden)


@dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    golden_answers: tuple[str, ...]
    category: str


def _golden(rec: dict[str, Any]) -> list[str]:
    g = rec.get("golden_answers")
    if g is None:
        g = rec.get("reward_model", {}).get("ground_truth", {}).get("target")
    if isinstance(g, str):
        g = [g]
    if g is None or len(g) == 0:
        raise KeyError("golden_answers")
    return [str(x) for x in g]


def _records(path: str) -> list[dict[str, Any]]:
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        return pq.read_table(path).to_pylist()
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from e
    return out


def load_questions(paths: list[str]) -> list[QAItem]:
    """QA items from each file in order (JSONL or Parquet, FlashRAG/Search-R1 layout)."""
    items: list[QAItem] = []
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        for n, rec in enumerate(_records(path)):
            try:
                items.append(QAItem(
                    id=str(rec.get("id", f"{stem}-{n}")),
                    question=str(rec["question"]).strip(),
                    golden_answers=tuple(_golden(rec)),
                    category=str(rec.get("data_source") or stem),
                ))
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}: record {n} lacks 'question' or 'golden_answers' ({e})") from e
    if not items:
        raise ValueError(f"config key 'env.options.questions': no QA items in {paths}")
    return items


class SearchQAEnv:
    """One question at a time; the retriever is shared (read-only) with other instances."""

    def __init__(self, items: list[QAItem], retriever: Retriever, top_k: int, wrong_answer: str = "end") -> None:
        self._items, self._retriever, self._top_k = items, retriever, top_k
        self._retry = wrong_answer == "retry"
        self.item: QAItem | None = None
        self._obs = ""

    def reset(self, data_idx: int) -> ResetResult:
        self.item = self._items[data_idx % len(self._items)]
        self._obs = PROMPT.format(question=self.item.question.strip())
        return ResetResult(observation=self._obs, info={"category": self.item.category, "item_id": self.item.id})

    def step(self, action: str) -> StepResult:
        if self.item is None:
            raise RuntimeError("step() before reset()")
        m = first_action(action)
        kind = m[0] if m else "invalid"
        reward, done = 0.0, False
        if m is None:
            obs = INVALID
        elif kind == "search":
            query = m[1].strip()
            if not query:
                obs = EMPTY_QUERY
            else:
                docs = self._retriever.search([query], self._top_k)[0]
                obs = f"<information>{passages(docs)}</information>"
        else:
            answer = (last_answer(action) or "").strip()
            if exact_match(answer, list(self.item.golden_answers)):
                obs, reward, done = RIGHT, 1.0, True
            else:
                obs, done = (WRONG_RETRY, False) if self._retry else (WRONG, True)
        self._obs = obs
        return StepResult(observation=obs, reward=reward, done=done, info={"success": reward == 1.0, "action": kind})

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self.item = None


OPTIONS: dict[str, Any] = {
    "retriever": "bm25",
    "corpus": "",
    "questions": "",
    "top_k": 3,
    "retriever_url": "",
    "retriever_timeout_s": 30.0,
    "wrong_answer": "end",
}
"""Every option this family reads, with its default (documented in the module docstring)."""


class SearchQAFamily:
    name = "searchqa"
    agentgym = AgentGymShape(create="bare_id", reset="text")

    def __init__(self, retriever: Retriever, items: list[QAItem], top_k: int = 3, wrong_answer: str = "end") -> None:
        if top_k < 1:
            raise ValueError("config key 'env.options.top_k': must be >= 1")
        if wrong_answer not in WRONG_ANSWER:
            raise ValueError(f"config key 'env.options.wrong_answer': {wrong_answer!r} is not one of {WRONG_ANSWER}")
        self.retriever, self.items, self.top_k, self.wrong_answer = retriever, items, top_k, wrong_answer

    def create(self) -> SearchQAEnv:
        return SearchQAEnv(self.items, self.retriever, self.top_k, self.wrong_answer)

    def num_tasks(self) -> int:
        return len(self.items)

    def close(self) -> None:
        self.retriever.close()


def make_retriever(opts: dict[str, Any]) -> Retriever:
    kind = opts["retriever"]
    if kind == "bm25":
        return BM25Retriever.from_jsonl(str(opts["corpus"]) or os.path.join(DATA_DIR, CORPUS_FILE))
    if kind == "http":
        return HttpRetriever(str(opts["retriever_url"]), float(opts["retriever_timeout_s"]))
    raise ValueError(f"config key 'env.options.retriever': {kind!r} is not 'bm25' or 'http'")


def make_family(cfg) -> SearchQAFamily:
    opts = read_options(cfg.options, OPTIONS, "searchqa")
    q = opts["questions"]
    paths = [str(p) for p in q] if isinstance(q, (list, tuple)) else ([str(q)] if q else [])
    items = load_questions(paths or [os.path.join(DATA_DIR, QUESTIONS_FILE)])
    return SearchQAFamily(make_retriever(opts), items, int(opts["top_k"]), str(opts["wrong_answer"]))
