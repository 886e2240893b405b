"""``turnscale bench fanout`` end to end, shortened (N=1,2, a 1 MB payload, the chain): on
the namespace cluster when it is available (root), else it must skip cleanly with the
reason.  Behaviour only; speed is not asserted (egress is: the relay serves one copy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from turnscale.cluster.netns import available


@pytest.mark.slow
def test_bench_fanout_smoke(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "turnscale", "bench", "fanout", "--fanout-n", "1,2", "--fanout-k", "1", "--fanout-mb", "1",
         "--fanout-rounds", "2", "--json", str(out_json)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok, why = available()
    if not ok:
        assert "fanout: skipped" in proc.stdout
        pytest.skip(f"namespace cluster unavailable: {why}")
    results = {r["name"]: r for r in json.loads(out_json.read_text())["results"]}
    assert set(results) == {f"fanout_{f}_n{n}" for n in (1, 2)
                            for f in ("star", "relay_k1", "relay_k1_vs_star", "egress_k1", "egress_star", "cpu_star", "cpu_k1")}
    assert results["fanout_egress_k1_n2"]["value"] == pytest.approx(1.0)  # a chain: the learner serves one copy
    assert results["fanout_egress_star_n2"]["value"] == pytest.approx(2.0)  # the star: one per puller
    cpu = {k for k in results if k.startswith("fanout_cpu_")}  # CPU s per version: 10 ms ticks, may read 0 for 1 MB
    assert all(r["value"] > 0 for k, r in results.items() if k not in cpu)
    assert all(results[k]["value"] >= 0 and results[k]["baseline_value"] > 0 for k in cpu)  # available CPU s > 0
