"""JsonlIndex: offsets, malformed lines, live appends; episode filters (pure)."""

from __future__ import annotations

import json

import pytest

from tests.sample_runs import write_run_dir
from turnscale.runindex import EpisodeFilter, FilterError, JsonlIndex, episode_summary, facets, metric_series, select


def test_index_reads_back_every_valid_episode_and_counts_malformed_lines(tmp_path):
    run = write_run_dir(tmp_path)
    idx = JsonlIndex(str(tmp_path / "trajectories.jsonl"), summarize=episode_summary)
    assert idx.refresh() == len(run.episodes)
    assert idx.bad_count == run.malformed_lines == 3
    reasons = [b.reason for b in idx.bad_examples]
    assert reasons[0] == "not UTF-8" and any(r.startswith("not JSON") for r in reasons) and any("list" in r for r in reasons)
    for i in (0, 7, len(run.episodes) - 1):
        assert idx.read(i) == run.episodes[i]
    assert "turns" not in idx.summaries[0] and "prompt" not in idx.summaries[0]
    with pytest.raises(IndexError):
        idx.read(len(run.episodes))


def test_index_follows_appends_and_waits_for_a_partial_last_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"step": 0, "env": "babyai"}) + "\n" + '{"step": 1, "en')
    idx = JsonlIndex(str(path))
    assert idx.refresh() == 1 and idx.bad_count == 0  # the unfinished line is not an error yet
    with open(path, "a") as f:
        f.write('v": "textcraft"}\n' + json.dumps({"step": 2}) + "\n")
    assert idx.refresh() == 2
    assert [s["step"] for s in idx.summaries] == [0, 1, 2]
    assert idx.read(1) == {"step": 1, "env": "textcraft"}
    assert idx.refresh() == 0


def test_index_survives_a_line_longer_than_its_read_chunk(tmp_path):
    path = tmp_path / "t.jsonl"
    big = {"step": 0, "prompt": "x" * 5000}
    path.write_text(json.dumps(big) + "\n" + json.dumps({"step": 1}) + "\n")
    idx = JsonlIndex(str(path))
    assert idx.refresh(chunk_bytes=64) == 2
    assert idx.read(0) == big and idx.read(1) == {"step": 1}


def test_index_starts_over_when_the_file_is_replaced_by_a_shorter_one(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(5)))
    idx = JsonlIndex(str(path))
    idx.refresh()
    path.write_text(json.dumps({"step": 9}) + "\n")
    idx.refresh()
    assert [s["step"] for s in idx.summaries] == [9]


def test_missing_file_is_an_empty_index(tmp_path):
    idx = JsonlIndex(str(tmp_path / "nope.jsonl"))
    assert idx.refresh() == 0 and len(idx) == 0


def test_filters_select_exactly_the_matching_episodes(tmp_path):
    run = write_run_dir(tmp_path, steps=8, seed=3)
    sums = [episode_summary(e) for e in run.episodes]
    flt = EpisodeFilter.from_query({"env": "babyai", "success": "false", "step_min": "2", "step_max": "5"})
    want = [i for i, e in enumerate(run.episodes)
            if e["env"] == "babyai" and not e["success"] and 2 <= e["step"] <= 5]
    total, page = select(sums, flt, 0, 1000)
    assert total == len(want) > 0 and [i for i, _ in page] == want
    total2, page2 = select(sums, flt, 1, 2)
    assert total2 == total and [i for i, _ in page2] == want[1:3]


def test_task_filter_takes_a_data_idx_or_a_task_id(tmp_path):
    run = write_run_dir(tmp_path, seed=5)
    sums = [episode_summary(e) for e in run.episodes]
    e0 = run.episodes[0]
    by_idx = select(sums, EpisodeFilter(task=str(e0["data_idx"])), 0, 999)[1]
    by_id = select(sums, EpisodeFilter(task=e0["task_id"]), 0, 999)[1]
    assert {i for i, _ in by_id} <= {i for i, _ in by_idx}
    assert all(s["task_id"] == e0["task_id"] for _, s in by_id)


def test_step_filter_and_version_range(tmp_path):
    run = write_run_dir(tmp_path, seed=1)
    sums = [episode_summary(e) for e in run.episodes]
    _, page = select(sums, EpisodeFilter(step=3), 0, 999)
    assert page and all(s["step"] == 3 for _, s in page)
    _, page = select(sums, EpisodeFilter(version_min=2, version_max=2), 0, 999)
    assert [i for i, _ in page] == [i for i, e in enumerate(run.episodes) if e["version"] == 2]


@pytest.mark.parametrize("query", [{"step_min": "x"}, {"success": "maybe"}, {"version_max": "1.5"}])
def test_bad_filter_values_raise_a_typed_error_naming_the_parameter(query):
    with pytest.raises(FilterError) as exc:
        EpisodeFilter.from_query(query)
    assert next(iter(query)) in str(exc.value)


def test_facets_and_metric_series(tmp_path):
    run = write_run_dir(tmp_path, seed=2)
    f = facets(episode_summary(e) for e in run.episodes)
    assert f["env"] == ["babyai", "textcraft"] and f["step_range"] == [0, 5]
    series = metric_series([{**m, "time": 1.7e9 + i} for i, m in enumerate(run.metrics)]
                           + [{"step": 9, "x": float("nan"), "flag": True}, {"no_step": 1}])
    assert series["rollout/success"] == [[m["step"], m["rollout/success"]] for m in run.metrics]
    assert "x" not in series and "flag" not in series and "time" not in series


from hypothesis import given, settings
from hypothesis import strategies as st

_objs = st.dictionaries(st.sampled_from(["step", "env", "x"]), st.one_of(st.integers(), st.text(max_size=30)), max_size=3)


@settings(max_examples=60, deadline=None)
@given(objs=st.lists(_objs, max_size=12), chunk=st.integers(1, 64), cuts=st.lists(st.integers(0, 2000), max_size=4))
def test_index_equals_the_valid_lines_whatever_the_chunking_and_append_points(tmp_path_factory, objs, chunk, cuts):
    path = tmp_path_factory.mktemp("h") / "t.jsonl"
    data = "".join(json.dumps(o) + "\n" for o in objs).encode()
    idx = JsonlIndex(str(path))
    path.write_bytes(b"")
    written = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        with open(path, "ab") as f:
            f.write(data[written:cut])
        written = max(written, cut)
        idx.refresh(chunk_bytes=chunk)
        complete = data[:written].count(b"\n")
        assert len(idx) == complete
    assert [idx.read(i) for i in range(len(idx))] == objs and idx.bad_count == 0
