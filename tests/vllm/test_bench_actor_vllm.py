"""``turnscale bench actor engine=vllm_cpu`` runs (small settings) on the real vLLM and
reports the actor-vs-bare-vLLM ratio and the weight-swap time in DESIGN.md §8's fields."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("vllm")

from turnscale.benchmarks import actor  # noqa: E402

pytestmark = pytest.mark.slow


def test_bench_actor_on_vllm_reports_actor_over_bare_vllm_and_swap_time(tiny_model_dir_hd32, capsys):
    parser = argparse.ArgumentParser()
    actor.add_arguments(parser)
    args = parser.parse_args(["--actor-model", tiny_model_dir_hd32, "--actor-batch", "4", "--actor-group", "2",
                              "--actor-rounds", "1", "--actor-turns", "2", "--actor-new-tokens", "8", "--actor-swaps", "2"])
    args.overrides = ["engine=vllm_cpu"]
    tokens, swap = actor.run(args)
    assert tokens.name == "actor_vllm_tokens_per_s" and tokens.target == 0.9 and tokens.value > 0 and tokens.baseline_value > 0
    assert swap.name == "vllm_weight_swap_s" and swap.unit == "s" and swap.value > 0
    assert abs(swap.ratio - swap.baseline_value / swap.value) < 1e-9  # lower is better
    out = capsys.readouterr().out
    assert "bench actor: actor" in out and "replay generated" not in out  # bare vLLM produced the same tokens
