"""``turnscale bench learner weights`` runs end to end (tiny sizes) and writes DESIGN §8 JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def test_learner_and_weights_benchmarks_write_their_figures(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "turnscale", "bench", "learner", "weights", "--json", str(out),
           "--learner-steps", "1", "--learner-groups", "1", "--learner-group-size", "2", "--learner-hidden", "32",
           "--learner-vocab", "256", "--weights-gb", "0.02", "--weights-repeats", "1", "--weights-chunk-mb", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    names = {r["name"]: r for r in data["results"]}
    assert {"learner_step_tokens_per_s", "learner_step_extra_prox", "learner_packed_vs_padded",
            "learner_padded_tokens_per_real", "learner_padded_tokens_per_real_padded", "weights_publish_to_actor_gbps",
            "weights_publish_to_actor_s", "weights_tcp_pull_vs_raw_zmq_gbps", "weights_vs_memcpy_gbps"} <= set(names)
    for r in data["results"]:
        assert r["value"] > 0 and r["baseline_value"] > 0 and r["ratio"] > 0
    assert names["learner_step_tokens_per_s"]["target"] == 0.9
    assert names["weights_publish_to_actor_gbps"]["target"] == 1.0
    # the packed learner step computes no padding: its padding ratio is the learner's own metric
    assert names["learner_padded_tokens_per_real"]["value"] == 1.0 and names["learner_padded_tokens_per_real"]["ok"]
    assert names["learner_padded_tokens_per_real_padded"]["value"] > 1.0
