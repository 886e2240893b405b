"""Document retrieval for SearchQA: one interface, an in-process BM25 and a Search-R1 HTTP client.

Corpus layout (Search-R1 / FlashRAG): JSONL, one ``{"id": str, "contents": "\\"Title\\"\\ntext"}``
per line; the first line of ``contents`` is the title (kept verbatim, quotes included, as
AgentGym renders it), the rest the text.

HTTP shape (Search-R1's ``retrieval_server.py``): ``POST <url> {"queries": [...], "topk": k,
"return_scores": true}`` -> ``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}``
(one list per query, best first); with ``return_scores`` false each entry is the document itself.
``python -m turnscale.envhub.retrieval_server`` serves that shape over a BM25 index.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

_TOKEN = re.compile(r"(?u)\b\w\w+\b")
STOPWORDS = frozenset(
    "a an and are as at be but by for from has have he her his in into is it its of on or she that the their "
    "there they this to was were which who whom what when where why how with did does do".split()
)


class RetrieverError(RuntimeError):
    """The retriever could not answer (unreachable service, malformed reply)."""


@dataclass(frozen=True)
class Doc:
    id: str
    contents: str
    score: float = 0.0

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""


class Retriever(Protocol):
    def search(self, queries: list[str], top_k: int) -> list[list[Doc]]:
        """Best ``top_k`` documents per query, best first (ties: lower corpus position first)."""

    def close(self) -> None: ...


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens of two or more characters, English stopwords removed."""
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


def load_corpus(path: str) -> list[Doc]:
    docs: list[Doc] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                docs.append(Doc(id=str(rec["id"]), contents=str(rec["contents"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a corpus record {{'id', 'contents'}}: {e}") from e
    if not docs:
        raise ValueError(f"{path}: the corpus is empty")
    return docs


class BM25Retriever:
    """In-process BM25 (``bm25s``, Lucene variant) over a corpus held in memory; thread-safe
    for concurrent ``search`` calls (the index is read-only after construction)."""

    def __init__(self, docs: Iterable[Doc]) -> None:
        import bm25s

        self.docs = list(docs)
        self._bm25 = bm25s.BM25()
        self._bm25.index([tokenize(d.contents) or ["<empty>"] for d in self.docs], show_progress=False)

    @classmethod
    def from_jsonl(cls, path: str) -> BM25Retriever:
        return cls(load_corpus(path))

    def search(self, queries: list[str], top_k: int) -> list[list[Doc]]:
        k = max(1, min(top_k, len(self.docs)))
        tokens = [tokenize(q) for q in queries]
        ids, scores = self._bm25.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        out: list[list[Doc]] = []
        for row_ids, row_scores, toks in zip(ids, scores, tokens):
            if not toks:
                out.append([])
                continue
            hits = [(int(i), float(s)) for i, s in zip(row_ids, row_scores) if s > 0]
            hits.sort(key=lambda h: (-h[1], h[0]))
            out.append([Doc(self.docs[i].id, self.docs[i].contents, s) for i, s in hits])
        return out

    def close(self) -> None:
        pass


class HttpRetriever:
    """Client of a Search-R1-style ``/retrieve`` service (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        import httpx

        if not url:
            raise ValueError("config key 'env.options.retriever_url': required when retriever is 'http'")
        self.url = url
        self._client = httpx.Client(timeout=timeout_s)

    def search(self, queries: list[str], top_k: int) -> list[list[Doc]]:
        import httpx

        body = {"queries": queries, "topk": top_k, "return_scores": True}
        try:
            resp = self._client.post(self.url, json=body)
        except httpx.HTTPError as e:
            raise RetrieverError(f"retriever {self.url} unreachable: {e}") from e
        if resp.status_code != 200:
            raise RetrieverError(f"retriever {self.url} answered HTTP {resp.status_code}")
        try:
            return [[_parse_hit(h) for h in row][:top_k] for row in resp.json()["result"]]
        except (ValueError, KeyError, TypeError) as e:
            raise RetrieverError(f"retriever {self.url} sent a malformed reply: {e}") from e

    def close(self) -> None:
        self._client.close()


def _parse_hit(hit: Any) -> Doc:
    if "document" in hit:
        doc, score = hit["document"], float(hit.get("score", 0.0))
    else:
        doc, score = hit, 0.0
    contents = doc.get("contents")
    if contents is None:  # some servers send title/text separately
        contents = f'"{doc["title"]}"\n{doc.get("text", "")}'
    return Doc(id=str(doc.get("id", "")), contents=str(contents), score=score)


def passages(docs: list[Doc]) -> str:
    """AgentGym's rendering: ``Doc 1(Title: t) text\\nDoc 2(Title: t) text`` (no trailing newline)."""
    return "".join(f"Doc {i + 1}(Title: {d.title}) {d.text}\n" for i, d in enumerate(docs)).strip()
