"""SearchQA with its retriever behind Search-R1's HTTP /retrieve shape, served by a real process."""

from __future__ import annotations

import httpx
import pytest

from turnscale.conf.schema import EnvConfig
from turnscale.envhub.retrieval import HttpRetriever, RetrieverError
from turnscale.envhub.searchqa import make_family

from ._serve import free_port, serve

pytest.importorskip("bm25s")


@pytest.fixture(scope="module")
def retrieval_url():
    port = free_port()
    with serve(["-m", "turnscale.envhub.retrieval_server", "--port", str(port)], f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}/retrieve"


def test_http_retriever_gives_the_same_docs_as_in_process_bm25(retrieval_url):
    local = make_family(EnvConfig(name="searchqa"))
    remote = make_family(EnvConfig(name="searchqa", options={"retriever": "http", "retriever_url": retrieval_url}))
    a, b = local.create(), remote.create()
    for idx in (0, 7, 42):
        assert a.reset(idx).observation == b.reset(idx).observation
        q = local.items[idx].question
        assert a.step(f"<search>{q}</search>").observation == b.step(f"<search>{q}</search>").observation
    remote.close()


def test_service_rejects_malformed_requests_with_a_json_error(retrieval_url):
    for body in ({"queries": "x"}, {"queries": ["x"], "topk": 0}, [1, 2]):
        r = httpx.post(retrieval_url, json=body)
        assert r.status_code == 422 and set(r.json()["error"]) == {"code", "message"}
    r = httpx.post(retrieval_url, json={"queries": ["a city"], "topk": 2, "return_scores": False})
    assert r.status_code == 200 and set(r.json()["result"][0][0]) == {"id", "contents"}


def test_unreachable_retriever_raises_a_typed_error():
    r = HttpRetriever(f"http://127.0.0.1:{free_port()}/retrieve", timeout_s=2.0)
    with pytest.raises(RetrieverError, match="unreachable"):
        r.search(["q"], 3)
