"""``turnscale view <run_dir | eval.json | trajectories.jsonl> [--port P] [--host 127.0.0.1]``.

A small local web app over a run directory: the page (``viewer_static/``, plain HTML/CSS/JS, no
external assets) talks to a JSON API served by a stdlib ``ThreadingHTTPServer``:

- ``GET /api/status``: files, counts, malformed-line counts and examples, filter facets.
- ``GET /api/episodes?env=&task=&split=&category=&checkpoint=&finish_reason=&success=&turn_limit=&step=&step_min=&step_max=&version_min=&version_max=&offset=&limit=``:
  one page of episode summaries (file order), ``{"total", "offset", "limit", "items": [{"id", ...}]}``.
- ``GET /api/episode/<id>``: the full record plus ``"id"`` and ``"same_task"`` (ids of other
  episodes of the same env + data_idx, for the compare view).
- ``GET /api/metrics``: ``{"series": {key: [[step, value], ...]}, "malformed": {...}}``.
- ``GET /api/eval``: the eval report JSON (404 when the source has none).
- ``GET /plots/<turn_scaling.png | pass_at_k.png>``: the eval report's plots.

Every API request first indexes bytes appended since the last one (``runindex.JsonlIndex``), so
a live run is followed; it never waits for a scan another thread is running (big files are
indexed in the background and answered from what is indexed so far).  Errors answer a JSON ``{"error": ...}`` with a real status code; no
stack trace reaches the client.  Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import mimetypes
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from turnscale.runindex import EpisodeFilter, FilterError, JsonlIndex, episode_summary, facets, metric_series, select

STATIC_DIR = Path(__file__).with_name("viewer_static")
STATIC_FILES = ("index.html", "app.js", "app.css")
PLOT_FILES = ("turn_scaling.png", "pass_at_k.png")
"""Plots ``turnscale eval`` writes beside its report; served from the eval JSON's folder only."""
MAX_PAGE = 500
BACKGROUND_INDEX_BYTES = 64 << 20
"""``turnscale view`` indexes larger trajectory files in the background (the page shows progress)."""
MAX_SAME_TASK = 200


class ViewerError(Exception):
    """The path given to ``turnscale view`` is not something it can show; the message says why."""


@dataclass(frozen=True)
class RunSource:
    """Where the files of one run (or eval output) are; any may be missing except one of them."""

    root: Path
    trajectories: Path
    metrics: Path
    eval_json: Path | None

    @staticmethod
    def resolve(path: str | Path) -> "RunSource":
        """A run dir (``trajectories.jsonl``, ``metrics.jsonl``, optional ``eval.json``), an eval JSON
        file (its ``"trajectories"`` entry or a sibling ``trajectories.jsonl``), or a JSONL file."""
        p = Path(path).expanduser()
        if p.is_dir():
            ev = p / "eval.json"
            if ev.is_file() and not (p / "trajectories.jsonl").is_file():
                return RunSource.resolve(ev)  # an eval output: follow its "trajectories" entry
            src = RunSource(p, p / "trajectories.jsonl", p / "metrics.jsonl", ev if ev.is_file() else None)
        elif p.is_file() and p.suffix == ".json":
            try:
                report = json.loads(p.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ViewerError(f"{p}: not a readable eval JSON ({exc})") from None
            traj = report.get("trajectories") if isinstance(report, dict) else None
            tpath = (p.parent / traj) if isinstance(traj, str) and traj else p.parent / "trajectories.jsonl"
            src = RunSource(p.parent, tpath, p.parent / "metrics.jsonl", p)
        elif p.is_file():
            src = RunSource(p.parent, p, p.parent / "metrics.jsonl", None)
        else:
            raise ViewerError(f"{p} does not exist; give a run directory (with trajectories.jsonl), an eval JSON or a JSONL file")
        if not (src.trajectories.is_file() or src.metrics.is_file() or src.eval_json):
            raise ViewerError(f"{p}: found neither trajectories.jsonl, metrics.jsonl nor an eval JSON")
        return src


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"


def _json(status: int, obj: object) -> Response:
    """JSON the browser can parse: NaN and infinities (which Python writes into JSONL) become null."""
    try:
        body = json.dumps(obj, allow_nan=False, default=str)
    except ValueError:
        body = json.dumps(_finite(obj), allow_nan=False, default=str)
    return Response(status, body.encode())


def _finite(obj: object) -> object:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class ViewerApp:
    """Routes requests to the indexes; ``handle`` is socket-free so it can be unit-tested."""

    def __init__(self, source: RunSource):
        self.source = source
        self.episodes = JsonlIndex(str(source.trajectories), summarize=episode_summary)
        self.metrics = JsonlIndex(str(source.metrics))

    def refresh(self, blocking: bool = False) -> None:
        """Index what was appended; a request (``blocking=False``) never waits for a scan that
        another thread is running, it answers from what is indexed so far."""
        self.episodes.refresh(blocking=blocking)
        self.metrics.refresh(blocking=blocking)

    def handle(self, raw_path: str) -> Response:
        url = urlsplit(raw_path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        path = url.path
        try:
            if path in ("/", "/index.html"):
                return self._static("index.html")
            if path.startswith("/static/"):
                return self._static(path[len("/static/"):])
            if path.startswith("/plots/"):
                return self._plot(path[len("/plots/"):])
            if path.startswith("/api/"):
                self.refresh()
                return self._api(path[len("/api/"):], query)
            return _json(404, {"error": f"no such page {path!r}"})
        except FilterError as exc:
            return _json(400, {"error": str(exc)})

    def _static(self, name: str) -> Response:
        if name not in STATIC_FILES:
            return _json(404, {"error": f"no such file {name!r}"})
        ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        return Response(200, (STATIC_DIR / name).read_bytes(), ctype)

    def plots(self) -> list[str]:
        ev = self.source.eval_json
        return [n for n in PLOT_FILES if ev is not None and (ev.parent / n).is_file()]

    def _plot(self, name: str) -> Response:
        if name not in self.plots():
            return _json(404, {"error": f"no such plot {name!r}"})
        return Response(200, (self.source.eval_json.parent / name).read_bytes(), "image/png")

    def _api(self, route: str, q: dict[str, str]) -> Response:
        if route == "status":
            return _json(200, self.status())
        if route == "episodes":
            return _json(200, self.list_episodes(q))
        if route.startswith("episode/"):
            ident = route[len("episode/"):]
            if not ident.isdigit():
                return _json(400, {"error": f"episode id must be a non-negative integer, got {ident!r}"})
            return self.episode(int(ident))
        if route == "metrics":
            return _json(200, {"series": metric_series(self.metrics.summaries), "malformed": self.metrics.bad_info()})
        if route == "eval":
            return self.eval_report()
        return _json(404, {"error": f"no such endpoint /api/{route}"})

    def status(self) -> dict:
        src = self.source
        return {
            "root": str(src.root),
            "files": {
                "trajectories": str(src.trajectories) if src.trajectories.is_file() else None,
                "metrics": str(src.metrics) if src.metrics.is_file() else None,
                "eval": str(src.eval_json) if src.eval_json else None,
                "plots": self.plots(),
            },
            "episodes": len(self.episodes),
            "bytes_indexed": self.episodes.scanned,
            "bytes_total": self.episodes.size(),
            "indexing": self.episodes.busy or self.metrics.busy,
            "malformed": {"trajectories": self.episodes.bad_info(), "metrics": self.metrics.bad_info()},
            "facets": facets(self.episodes.summaries),
        }

    def list_episodes(self, q: dict[str, str]) -> dict:
        flt = EpisodeFilter.from_query(q)
        offset = _int_param(q, "offset", 0, 0, None)
        limit = _int_param(q, "limit", 50, 1, MAX_PAGE)
        total, page = select(self.episodes.summaries, flt, offset, limit)
        return {"total": total, "offset": offset, "limit": limit, "items": [{"id": i, **e} for i, e in page]}

    def episode(self, i: int) -> Response:
        try:
            rec = self.episodes.read(i)
        except IndexError:
            return _json(404, {"error": f"no episode {i} (the run has {len(self.episodes)})"})
        env, idx = rec.get("env"), rec.get("data_idx")
        same = [j for j, e in enumerate(self.episodes.summaries)
                if j != i and e.get("env") == env and e.get("data_idx") == idx][:MAX_SAME_TASK]
        return _json(200, {"id": i, **rec, "same_task": same})

    def eval_report(self) -> Response:
        if self.source.eval_json is None:
            return _json(404, {"error": "this run has no eval report"})
        try:
            return _json(200, json.loads(self.source.eval_json.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _json(422, {"error": f"eval report {self.source.eval_json.name} is unreadable: {exc}"})


def _int_param(q: dict[str, str], name: str, default: int, lo: int, hi: int | None) -> int:
    v = q.get(name, "").strip()
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        raise FilterError(f"parameter '{name}': expected an integer, got {v!r}") from None
    if n < lo:
        raise FilterError(f"parameter '{name}': must be >= {lo}")
    return n if hi is None else min(n, hi)


def _make_handler(app: ViewerApp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "turnscale-view"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            try:
                resp = app.handle(self.path)
            except Exception as exc:  # never a traceback to the client
                print(f"turnscale view: error on {self.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
                resp = _json(500, {"error": "internal error; see the viewer's terminal"})
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(resp.body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


class ViewerServer:
    """The HTTP server in a daemon thread; ``url`` is where it listens; ``close()`` stops it."""

    def __init__(self, app: ViewerApp, host: str = "127.0.0.1", port: int = 0):
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(app))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="viewer-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> "ViewerServer":
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve(path: str | Path, host: str = "127.0.0.1", port: int = 0, wait: bool = True) -> ViewerServer:
    """Serve ``path``; the caller closes the returned server.  With ``wait`` the files are indexed
    before this returns; without, indexing runs in a background thread while the page already
    answers (``/api/status`` says ``"indexing": true`` until it is done)."""
    app = ViewerApp(RunSource.resolve(path))
    if wait:
        app.refresh(blocking=True)
        return ViewerServer(app, host, port).start()
    server = ViewerServer(app, host, port).start()
    threading.Thread(target=app.refresh, kwargs={"blocking": True}, name="viewer-index", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="turnscale view", description="Browse a run's trajectories and curves in a local web app.")
    ap.add_argument("path", help="run directory, eval JSON, or trajectories JSONL file")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8765, help="port (0: any free port)")
    args = ap.parse_args(argv)
    try:
        source = RunSource.resolve(args.path)
        big = source.trajectories.is_file() and source.trajectories.stat().st_size > BACKGROUND_INDEX_BYTES
        server = serve(args.path, args.host, args.port, wait=not big)
    except ViewerError as exc:
        print(f"turnscale view: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"turnscale view: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"turnscale view: listening on {args.host}: anyone who can reach it can read these trajectories", file=sys.stderr)
    print(f"turnscale view: serving {args.path} at {server.url} (Ctrl-C to stop)", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
