"""learner/ranks.py and the trainer's multi-rank invariant, in one process: the split by
tokens, plan padding, zero-weight pad micro-batches, and the one-frame codec records the
ranks exchange (the real two-rank runs are tests/integration/test_learner_ranks.py and
test_trainer_ddp.py)."""

from __future__ import annotations

import numpy as np
import pytest

from turnscale.benchmarks.synthetic import build_tiny_model, synthetic_groups
from turnscale.conf.schema import Config
from turnscale.learner.ranks import _NO_OUT_OF_BAND, group_tokens, split_by_tokens
from turnscale.learner.trainer import Trainer, pad_plan
from turnscale.protocol import codec
from turnscale.protocol.messages import RankShare


def test_split_keeps_groups_whole_and_balances_tokens():
    tokens = [100, 10, 60, 50, 40, 30]
    shares = split_by_tokens(tokens, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))  # every group once, none split
    assert all(s == sorted(s) for s in shares)  # batch order within a share
    loads = [sum(tokens[i] for i in s) for s in shares]
    assert loads == [140, 150] or loads == [150, 140]
    assert split_by_tokens([5], 3) == [[0], [], []]  # fewer groups than ranks: empty shares
    assert split_by_tokens([], 2) == [[], []]
    with pytest.raises(ValueError, match="world size"):
        split_by_tokens([1], 0)


def test_pad_plan_appends_empty_micro_batches_and_refuses_to_shrink():
    assert pad_plan([[0, 1], [2]], 4) == [[0, 1], [2], [], []]
    assert pad_plan([], 2) == [[], []]
    with pytest.raises(ValueError, match="cannot pad"):
        pad_plan([[0], [1]], 1)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_pad_micro_batch_runs_forward_and_backward_and_adds_no_gradient(tmp_path, algo):
    path = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=256, intermediate=64)
    cfg = Config()
    cfg.algo.name = algo
    tr = Trainer(cfg, path)
    tr._pad_micro_batch()
    grads = [p.grad for p in tr.params]
    assert all(g is not None for g in grads)  # every parameter took part (DDP's reducer needs that)
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_share_is_one_codec_frame_and_round_trips():
    groups = synthetic_groups(2, 4, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4)
    share = RankShare(step=3, total_groups=5, indices=[1, 4], groups=groups)
    frames = codec.encode(share, out_of_band_bytes=_NO_OUT_OF_BAND)
    assert len(frames) == 1
    back = codec.decode([bytes(frames[0])], expect=RankShare)
    assert back.indices == [1, 4] and len(back.groups) == 2
    for a, b in zip(groups, back.groups):
        assert group_tokens(a) == group_tokens(b)
        for ea, eb in zip(a.episodes, b.episodes):
            assert np.array_equal(ea.token_ids, eb.token_ids) and np.array_equal(ea.logprobs, eb.logprobs)
