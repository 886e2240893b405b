"""The viewer's JSON API over a real socket on 127.0.0.1 (server in a thread, sample run dir)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.sample_runs import write_run_dir
from turnscale.viewer import RunSource, ViewerError, serve


def get(url: str) -> tuple[int, dict | bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers["Content-Type"].startswith("application/json") else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture()
def served(tmp_path):
    run = write_run_dir(tmp_path / "run")
    server = serve(tmp_path / "run")
    yield run, server.url
    server.close()


def test_status_reports_counts_facets_and_malformed_lines(served):
    run, url = served
    code, s = get(url + "api/status")
    assert code == 200 and s["episodes"] == len(run.episodes)
    assert s["malformed"]["trajectories"]["count"] == 3 and s["malformed"]["metrics"]["count"] == 1
    assert s["facets"]["env"] == ["babyai", "textcraft"]
    assert url.startswith("http://127.0.0.1:")


def test_episode_list_is_filtered_and_paginated(served):
    run, url = served
    want = [i for i, e in enumerate(run.episodes) if e["env"] == "textcraft" and e["success"]]
    code, page = get(url + "api/episodes?env=textcraft&success=true&limit=2&offset=1")
    assert code == 200 and page["total"] == len(want)
    assert [e["id"] for e in page["items"]] == want[1:3]
    code, page = get(url + "api/episodes?finish_reason=turn_limit")
    assert all(e["finish_reason"] == "turn_limit" for e in page["items"]) and page["total"] > 0


def test_episode_detail_has_all_turns_and_same_task_ids(served):
    run, url = served
    code, ep = get(url + "api/episode/0")
    assert code == 200 and ep["turns"] == run.episodes[0]["turns"] and ep["id"] == 0
    same = [j for j, e in enumerate(run.episodes) if j and e["env"] == ep["env"] and e["data_idx"] == ep["data_idx"]]
    assert ep["same_task"] == same and same


@pytest.mark.parametrize("path,code", [("api/episode/9999", 404), ("api/episode/-1", 400), ("api/episodes?step_min=a", 400),
                                       ("api/nope", 404), ("static/../viewer.py", 404), ("api/eval", 404)])
def test_bad_requests_get_a_json_error_and_a_real_status(served, path, code):
    _, url = served
    got, body = get(url + path)
    assert got == code and isinstance(body, dict) and body["error"] and "Traceback" not in body["error"]


def test_page_and_assets_are_served_without_external_urls(served):
    _, url = served
    code, html = get(url)
    assert code == 200 and b"/static/app.js" in html
    for name in ("app.js", "app.css"):
        code, body = get(url + "static/" + name)
        assert code == 200
        assert b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"") and b"https://" not in body


def test_a_live_run_is_followed(served):
    run, url = served
    path = run.path / "trajectories.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({**run.episodes[0], "step": 99}) + "\n")
    _, page = get(url + "api/episodes?step=99")
    assert page["total"] == 1


def test_metrics_endpoint_gives_series_per_key(served):
    run, url = served
    _, m = get(url + "api/metrics")
    assert m["series"]["schedule/turn_limit"] == [[r["step"], r["schedule/turn_limit"]] for r in run.metrics]


def test_an_eval_json_is_a_source_with_its_report(tmp_path):
    write_run_dir(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({"rows": [], "k": [1], "trajectories": "trajectories.jsonl"}))
    server = serve(tmp_path / "report.json")
    try:
        code, rep = get(server.url + "api/eval")
        assert code == 200 and rep["k"] == [1]
        assert get(server.url + "plots/turn_scaling.png")[0] == 404  # none written beside this report
    finally:
        server.close()


def test_a_path_with_nothing_to_show_is_a_clear_error(tmp_path):
    with pytest.raises(ViewerError, match="does not exist"):
        RunSource.resolve(tmp_path / "missing")
    with pytest.raises(ViewerError, match="neither"):
        RunSource.resolve(tmp_path)


def test_nan_and_infinity_in_records_are_served_as_null(tmp_path):
    run = write_run_dir(tmp_path, malformed=False)
    ep = {**run.episodes[0], "reward": float("nan")}
    ep["turns"] = [{**ep["turns"][0], "logprob_min": float("-inf")}]
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write(json.dumps(ep) + "\n")  # Python writes NaN / -Infinity
    server = serve(tmp_path)
    try:
        n = len(run.episodes)
        code, rec = get(server.url + f"api/episode/{n}")
        assert code == 200 and rec["reward"] is None and rec["turns"][0]["logprob_min"] is None
        code, page = get(server.url + f"api/episodes?offset={n}")
        assert code == 200 and page["items"][0]["reward"] is None
    finally:
        server.close()


def test_requests_are_answered_while_a_big_file_is_still_being_indexed(tmp_path):
    import threading

    from turnscale.viewer import RunSource, ViewerApp

    run = write_run_dir(tmp_path, malformed=False)
    app = ViewerApp(RunSource.resolve(tmp_path))
    app.episodes._lock.acquire()  # a background scan holds the index
    try:
        done = threading.Event()
        result = {}

        def ask():
            result["status"] = json.loads(app.handle("/api/status").body)
            done.set()

        threading.Thread(target=ask, daemon=True).start()
        assert done.wait(5), "a request waited for the scan"
        assert result["status"]["indexing"] is True and result["status"]["episodes"] == 0
    finally:
        app.episodes._lock.release()
    status = json.loads(app.handle("/api/status").body)
    assert status["indexing"] is False and status["episodes"] == len(run.episodes)
    assert status["bytes_indexed"] == status["bytes_total"] > 0


def test_serve_without_waiting_indexes_in_the_background(tmp_path):
    import time

    run = write_run_dir(tmp_path, malformed=False)
    server = serve(tmp_path, wait=False)
    try:
        deadline = time.monotonic() + 10
        while True:
            _, s = get(server.url + "api/status")
            if not s["indexing"] and s["episodes"] == len(run.episodes):
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.close()


def test_view_cli_errors_exit_2_with_a_message(tmp_path, capsys):
    import socket

    from turnscale.viewer import main

    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    write_run_dir(tmp_path, malformed=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main([str(tmp_path), "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
