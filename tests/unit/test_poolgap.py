"""Per-pool staleness and behaviour-vs-learner log-prob gap (``learner.poolgap``): the
aggregation by pool with hand-computed numbers, and the trainer's per-group sums on the
padded and the packed path (a real tiny model; ``mu`` set to the learner's own log-probs
shifted by a known amount per group)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from turnscale.learner.metrics import StepMetrics, format_progress
from turnscale.learner.poolgap import GroupGap, PoolGroup, record_pool_gaps

torch.set_num_threads(1)


def test_pool_gaps_are_token_weighted_per_pool_with_staleness0_groups_apart():
    m = StepMetrics()
    record_pool_gaps(m, [
        PoolGroup("cpu", 0, GroupGap(tokens=10, abs_gap_sum=1e-6, weight_sum=10.0)),
        PoolGroup("cpu", 2, GroupGap(tokens=30, abs_gap_sum=6.0, weight_sum=36.0)),
        PoolGroup("gpu", 1, GroupGap(tokens=20, abs_gap_sum=1.0, weight_sum=22.0)),
        PoolGroup("gpu", 0, GroupGap(tokens=0, abs_gap_sum=0.0, weight_sum=0.0)),  # nothing trainable
        PoolGroup("sft", 0, None),  # a trainer that reports no gaps: staleness only
    ])
    out = m.reduce()
    assert out["pool/cpu/staleness_mean"] == 1.0 and out["pool/gpu/staleness_mean"] == 0.5
    assert out["pool/cpu/logprob_gap_mean"] == pytest.approx((1e-6 + 6.0) / 40)
    assert out["pool/cpu/behaviour_weight_mean"] == pytest.approx(46.0 / 40)
    assert out["pool/cpu/logprob_gap_mean_staleness0"] == pytest.approx(1e-7)
    assert out["pool/cpu/behaviour_weight_mean_staleness0"] == 1.0
    assert out["pool/gpu/logprob_gap_mean"] == 0.05 and out["pool/gpu/behaviour_weight_mean"] == 1.1
    assert "pool/gpu/logprob_gap_mean_staleness0" not in out  # its staleness-0 group had no loss token
    assert out["pool/sft/staleness_mean"] == 0 and not any(k.startswith("pool/sft/") and "gap" in k for k in out)


def test_per_row_gap_sums_count_only_loss_tokens():
    from turnscale.learner.loss import behaviour_gap_sums_B

    prox = torch.tensor([[0.0, -1.0, -2.0, -3.0], [-1.0, -1.0, 5.0, 0.0]])
    mu = torch.tensor([[9.0, -1.5, -1.0, float("nan")], [-1.0, -0.5, 100.0, 0.0]])  # masked tokens: anything
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    tokens, gap, weight = behaviour_gap_sums_B(prox_logprobs_BT=prox, behaviour_logprobs_BT=mu, mask_BT=mask)
    assert tokens.tolist() == [2.0, 2.0]
    assert gap.tolist() == pytest.approx([0.5 + 1.0, 0.0 + 0.5])
    assert weight.tolist() == pytest.approx([math.exp(0.5) + math.exp(-1.0), 1.0 + math.exp(-0.5)])


def test_the_console_line_shows_each_pools_gap_and_its_staleness0_gap():
    m = {"pool/cpu/actors": 1.0, "pool/cpu/staleness_mean": 0.5, "pool/cpu/logprob_gap_mean": 0.02,
         "pool/cpu/logprob_gap_mean_staleness0": 3e-7, "pool/gpu/actors": 2.0, "pool/gpu/logprob_gap_mean": 0.031}
    line = format_progress(3, m)
    assert "| pools cpu 1a 0tok/s st0.50 gap0.02/3e-07, gpu 2a 0tok/s gap0.031" in line


def test_the_console_line_has_no_pool_part_for_the_default_pool_alone():
    assert "pools" not in format_progress(1, {"pool/default/actors": 2.0, "pool/default/logprob_gap_mean": 0.1})


def test_console_line_names_the_learner_ranks_of_a_multi_rank_learner():
    assert "| learner ranks 4" in format_progress(1, {"perf/learner_ranks": 4.0})  # learner/ranks.py sets it
    assert "ranks" not in format_progress(1, {"perf/version": 1.0})  # a one-process learner: not shown


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from turnscale.benchmarks.synthetic import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), hidden=32, layers=2, vocab=256, intermediate=64)


def own_logprobs(trainer, token_ids):
    """The learner model's log-probs for one episode (teacher-forced, padded layout, 1 row)."""
    from turnscale.learner.logprobs import token_logprobs_BT

    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))[None]
        logits = trainer.hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return token_logprobs_BT(logits, ids, trainer.temperature)[0].numpy()


@pytest.mark.parametrize("packing", ["padded", "varlen"])
def test_the_trainer_reports_each_groups_logprob_gap_on_both_batch_layouts(model_dir, packing):
    """Group 0's ``mu`` is the learner's own log-prob + 0.25, group 1's - 0.5 (group 2 exactly
    the learner's): the per-group sums give |gap| 0.25 / 0.5 / 0 and weights exp(-0.25) /
    exp(0.5) / 1 per token, over micro-batches that mix groups (a small token budget)."""
    from turnscale.benchmarks.synthetic import synthetic_groups
    from turnscale.conf.schema import Config
    from turnscale.learner.trainer import Trainer

    cfg = Config()
    cfg.algo.name, cfg.algo.packing, cfg.algo.micro_batch_tokens, cfg.learner.steps = "grpo", packing, 64, 2
    trainer = Trainer(cfg, model_dir)
    groups = synthetic_groups(3, 3, vocab=256, prompt_len=6, turns=2, tokens_per_turn=5, obs_len=4, max_turns=3, seed=3)
    shifts = (0.25, -0.5, 0.0)
    groups = [dataclasses.replace(g, episodes=[
        dataclasses.replace(ep, logprobs=(own_logprobs(trainer, ep.token_ids) + s).astype(np.float32)) for ep in g.episodes])
        for g, s in zip(groups, shifts)]
    out = trainer.train_step(groups)
    assert trainer.step == 1 and math.isfinite(out["loss/policy_loss"])
    gaps = trainer.last_group_gaps
    assert len(gaps) == 3
    for g, gap, s in zip(groups, gaps, shifts):
        assert gap.tokens == sum(int(np.asarray(ep.loss_mask).sum()) for ep in g.episodes)
        assert gap.abs_gap_sum / gap.tokens == pytest.approx(abs(s), abs=1e-4)
        assert gap.weight_sum / gap.tokens == pytest.approx(math.exp(-s), abs=1e-4)
    total = sum(gaps, GroupGap())
    assert total.tokens == out["perf/loss_tokens"]
    assert total.weight_sum / total.tokens == pytest.approx(out["loss/behaviour_weight_mean"], rel=1e-5)  # cap 2 not reached


def test_an_sft_step_reports_no_gaps(model_dir):
    from turnscale.benchmarks.synthetic import synthetic_groups
    from turnscale.conf.schema import Config
    from turnscale.learner.trainer import Trainer

    cfg = Config()
    cfg.algo.name = "sft"
    trainer = Trainer(cfg, model_dir)
    trainer.train_step(synthetic_groups(1, 2, vocab=256, prompt_len=6, turns=1, tokens_per_turn=4, obs_len=3))
    assert trainer.last_group_gaps == []
