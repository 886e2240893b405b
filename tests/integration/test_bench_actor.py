"""``turnscale bench actor`` runs end to end (small settings) and reports the DESIGN.md §8 fields."""

from __future__ import annotations

import argparse

from turnscale.benchmarks import actor


def test_bench_actor_reports_actor_over_bare_engine_ratio(tiny_model_dir, capsys):
    parser = argparse.ArgumentParser()
    actor.add_arguments(parser)
    args = parser.parse_args(["--actor-model", tiny_model_dir, "--actor-batch", "4", "--actor-group", "2",
                              "--actor-rounds", "1", "--actor-turns", "2", "--actor-new-tokens", "8"])
    [res] = actor.run(args)
    assert res.name == "actor_tokens_per_s" and res.unit == "tok/s" and res.target == 0.9
    assert res.value > 0 and res.baseline_value > 0 and abs(res.ratio - res.value / res.baseline_value) < 1e-9
    out = capsys.readouterr().out
    assert "bench actor: actor" in out and "replay generated" not in out  # the replay produced the same tokens
