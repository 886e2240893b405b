"""A Search-R1-compatible retrieval service over an in-process BM25 index.

``python -m turnscale.envhub.retrieval_server --corpus corpus.jsonl --host 127.0.0.1 --port 8000`` serves
``POST /retrieve {"queries": [...], "topk": k, "return_scores": bool}`` ->
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (or bare documents when
``return_scores`` is false) and ``GET /health``.  Lets many SearchQA servers share one index, and
is what the HTTP retriever is tested against.  Malformed bodies get 422 with
``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import argparse
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from turnscale.envhub.retrieval import BM25Retriever, Retriever
from turnscale.envhub.searchqa_data import CORPUS_FILE, DATA_DIR

MAX_QUERIES, MAX_TOPK = 1024, 100


def create_app(retriever: Retriever):
    app = FastAPI()

    def error(status: int, code: str, message: str) -> JSONResponse:
        return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error(422, "bad_json", "body is not JSON")
        queries = body.get("queries") if isinstance(body, dict) else None
        topk = body.get("topk", 3) if isinstance(body, dict) else None
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries) or len(queries) > MAX_QUERIES:
            return error(422, "bad_queries", f"'queries' must be a list of at most {MAX_QUERIES} strings")
        if not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
            return error(422, "bad_topk", f"'topk' must be an integer in 1..{MAX_TOPK}")
        rows = retriever.search(queries, topk)
        if body.get("return_scores", False):
            result = [[{"document": {"id": d.id, "contents": d.contents}, "score": d.score} for d in r] for r in rows]
        else:
            result = [[{"id": d.id, "contents": d.contents} for d in r] for r in rows]
        return {"result": result}

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", default=os.path.join(DATA_DIR, CORPUS_FILE))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    import uvicorn

    uvicorn.run(create_app(BM25Retriever.from_jsonl(args.corpus)), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
