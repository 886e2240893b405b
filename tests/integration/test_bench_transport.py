"""``turnscale bench transport`` end to end, shortened: real processes over tcp loopback,
the JSON of DESIGN.md section 8 and the chart.  Behaviour only; speed is not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from turnscale.benchmarks.transport import make_group
from turnscale.protocol import codec

KEYS = {"name", "value", "unit", "baseline", "baseline_value", "ratio", "target", "ok"}


def test_bench_transport_writes_results_json_and_chart(tmp_path):
    out_json, plots = tmp_path / "bench.json", tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "turnscale", "bench", "transport", "--transport-sizes", "64KB,1MB", "--transport-seconds", "0.3",
         "--transport-repeats", "1", "--json", str(out_json), "--plot", str(plots)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out_json.read_text())
    assert {"platform", "python", "cpus"} <= set(doc["machine"])
    names = [r["name"] for r in doc["results"]]
    figures = ("mb_s", "groups_s", "cpu_us", "trio_bytes_mb_s", "trio_bytes_cpu_us")  # with the socket-path ceiling
    assert names == [f"transport_{s}_{f}" for s in ("64KB", "1MB") for f in figures]
    for r in doc["results"]:
        assert set(r) == KEYS
        assert r["value"] > 0 and r["baseline_value"] > 0
        lower_is_better = r["name"].endswith("_cpu_us")  # ratio oriented so that higher is better
        expected = r["baseline_value"] / r["value"] if lower_is_better else r["value"] / r["baseline_value"]
        assert r["ratio"] == pytest.approx(expected)
    assert (plots / "ratios.png").stat().st_size > 0
    assert "transport_1MB_mb_s" in proc.stdout


def test_a_steady_state_benchmark_group_of_4mb_is_a_header_and_one_data_frame():
    """As an actor's group is once its ``BlockSizer`` has seen one like it."""
    group, _ = make_group(4 << 20)
    assert len(codec.encode(group)) == 2


@pytest.mark.parametrize("target", [64 << 10, 4 << 20])
def test_benchmark_groups_are_valid_and_about_the_requested_size(target):
    group, nbytes = make_group(target)
    frames = codec.encode(group)
    assert nbytes == sum(memoryview(f).nbytes for f in frames)
    assert abs(nbytes - target) / target < 0.05
    decoded = codec.decode(frames)
    assert len(decoded.episodes) == 8 and all(len(ep.turns) == 8 for ep in decoded.episodes)
