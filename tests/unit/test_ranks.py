"""learner/ranks.py and the trainer's multi-rank invariant, in one process: the split by
tokens, plan padding, zero-weight pad micro-batches, and the one-frame codec records the
ranks exchange (the real two-rank runs are tests/integration/test_learner_ranks.py and
test_trainer_ddp.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnscale.benchmarks.synthetic import build_tiny_model, synthetic_groups
from turnscale.conf.schema import Config
from turnscale.learner.poolgap import GroupGap
from turnscale.learner.ranks import _NO_OUT_OF_BAND, RankError, RankedTrainer, group_tokens, split_by_tokens
from turnscale.learner.trainer import Trainer, pad_plan
from turnscale.protocol import codec
from turnscale.protocol.messages import RankShare, RankStop


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


class _FakeChannel:
    """Records what rank 0 sends; ``sum_gaps`` returns rank 0's gaps placed in the batch."""

    world = 2

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def send(self, dst, msg):
        self.sent.append((dst, msg))

    def broadcast(self, msg):
        self.send(1, msg)

    follower_dropped: set[int] = set()
    """Batch positions a follower's trainer dropped (what the all-reduce would bring back)."""

    def sum_gaps(self, gaps, indices, total, dropped=()):
        out = [GroupGap()] * total
        for i, g in zip(indices, gaps):
            out[i] = g
        return out, {indices[k] for k in dropped} | self.follower_dropped


class _FakeTrainer:
    def __init__(self, fail: Exception | None = None) -> None:
        self.step, self.fail, self.trained = 0, fail, []
        self.last_group_gaps: list[GroupGap] = []
        self.accelerator = type("A", (), {"distributed_type": "MULTI_CPU"})()

    def train_step(self, groups):
        if self.fail is not None:
            raise self.fail
        self.trained.append(list(groups))
        self.last_group_gaps = [GroupGap(tokens=1.0)] * len(groups)
        self.step += 1
        return {"loss/policy_loss": 0.0}


def test_rank_0_sends_each_follower_its_share_and_trains_its_own():
    groups = synthetic_groups(3, 2, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4)
    ch, tr = _FakeChannel(), _FakeTrainer()
    ranked = RankedTrainer(tr, ch, timeout_s=600)
    try:
        out = ranked.train_step(groups)
    finally:
        ranked.stop("done")
    shares = split_by_tokens([group_tokens(g) for g in groups], 2)
    (dst, share), (_, stop) = ch.sent
    assert dst == 1 and isinstance(share, RankShare) and share.indices == shares[1] and share.total_groups == 3
    assert [g.lease_id for g in share.groups] == [groups[i].lease_id for i in shares[1]]
    assert [g.lease_id for g in tr.trained[0]] == [groups[i].lease_id for i in shares[0]]
    assert isinstance(stop, RankStop) and stop.reason == "done"
    assert out["perf/learner_ranks"] == 2.0 and len(ranked.last_group_gaps) == 3 and ranked.step == 1


def test_rank_0_reports_a_collective_failure_as_a_lost_rank_and_other_errors_as_they_are():
    groups = synthetic_groups(2, 2, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4)
    lost = RankedTrainer(_FakeTrainer(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")),
                         _FakeChannel(), timeout_s=600)
    with pytest.raises(RankError, match="a learner rank failed while rank 0 was training a step"):
        lost.train_step(groups)
    oom = RankedTrainer(_FakeTrainer(RuntimeError("CUDA out of memory")), _FakeChannel(), timeout_s=600)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        oom.train_step(groups)
    assert not isinstance(info.value, RankError)
    for r in (lost, oom):
        r.stop("error")


def test_accelerates_own_fsdp_is_refused_with_a_clear_error():
    tr = _FakeTrainer()
    tr.accelerator.distributed_type = "DistributedType.FSDP"
    with pytest.raises(RankError, match="learner.strategy=fsdp"):
        RankedTrainer(tr, _FakeChannel(), timeout_s=600)


def test_learner_strategy_and_fsdp_dtypes_are_validated():
    from turnscale.conf.schema import FsdpConfig, LearnerConfig

    assert LearnerConfig().strategy == "ddp" and FsdpConfig().param_dtype == "auto"
    with pytest.raises(ValueError, match="learner.strategy"):
        LearnerConfig(strategy="zero3")
    with pytest.raises(ValueError, match="learner.fsdp.param_dtype"):
        FsdpConfig(param_dtype="int8")
    with pytest.raises(ValueError, match="learner.fsdp.reduce_dtype"):
        FsdpConfig(reduce_dtype="auto")
    from turnscale.learner.fsdp import param_dtype

    assert param_dtype("auto", "cpu") == torch.float32 and param_dtype("auto", "cuda:1") == torch.bfloat16


class _ShardedFake(_FakeTrainer):
    """A sharded trainer's surface: ``model`` (plain tensors gather to themselves) and a writer."""

    sharded = True

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(3, 2)
        self.written: list[str] = []

    def state_writer(self):
        return self.written.append


def test_sharded_publication_lays_out_without_gathering_then_gathers_with_every_rank_as_read():
    from turnscale.protocol.messages import RankCollective
    from turnscale.protocol.weights import layout

    ch, tr = _FakeChannel(), _ShardedFake()
    ranked = RankedTrainer(tr, ch, timeout_s=600)
    try:
        sd = ranked.state_dict_for_publish("bfloat16")
        infos, total = layout(sd, "bfloat16")
        assert [i.name for i in infos] == ["weight", "bias"] and total == 16 and ch.sent == []  # nothing gathered yet
        values = [t for _, t in zip(list(sd), sd.values())]  # as the publisher reads it: stops at the last name
        assert ch.sent == [(1, RankCollective(kind="publish", step=0, dtype="bfloat16"))]
        assert ranked._lock.acquire(blocking=False)  # the channel is free once the last tensor is out
        ranked._lock.release()
        assert [v.dtype for v in values] == [torch.bfloat16] * 2
        assert torch.equal(values[0], tr.model.weight.detach().to(torch.bfloat16))
        ranked.state_writer()("/ckpt/.tmp-step-1")
        assert ch.sent[-1] == (1, RankCollective(kind="checkpoint", step=0, path="/ckpt/.tmp-step-1"))
        assert tr.written == ["/ckpt/.tmp-step-1"]
    finally:
        ranked.stop("done")


@pytest.mark.parametrize("grad", [False, True])
def test_pad_micro_batch_runs_the_forwards_of_a_real_micro_batch(tmp_path, grad):
    """Under FSDP every forward of a sharded module is a collective, so a pad must run the
    modules a real micro-batch runs: the critic in both passes, the reference in the update."""
    path = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=256, intermediate=64)
    cfg = Config()
    cfg.algo.name, cfg.algo.kl_coef = "ppo", 0.1
    tr = Trainer(cfg, path)
    calls: list[str] = []
    tr.value_head.register_forward_hook(lambda *a: calls.append("critic"))
    tr.ref_model.register_forward_hook(lambda *a: calls.append("reference"))
    groups = synthetic_groups(1, 2, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4)
    rows, _ = tr._rows(groups, trim=False)
    tr.last_group_gaps = [GroupGap()]
    with torch.set_grad_enabled(grad):
        if grad:
            tr._policy_micro_batch(rows, 10.0)
        else:
            tr._forward(rows, tr._collate(rows), grad_entropy=False)
        real, calls[:] = list(calls), []
        tr._pad_micro_batch()
    assert calls == real == (["critic", "reference"] if grad else ["critic"])


def test_groups_dropped_on_any_rank_are_reported_by_batch_position():
    """Rank 0 re-issues every dropped group's task, also those a follower dropped."""
    groups = synthetic_groups(4, 2, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4)
    shares = split_by_tokens([group_tokens(g) for g in groups], 2)
    ch, tr = _FakeChannel(), _FakeTrainer()
    ch.follower_dropped = {shares[1][0]}
    tr.last_dropped = {0: "episodes[0].reward: not finite"}  # rank 0's trainer dropped its first group
    ranked = RankedTrainer(tr, ch, timeout_s=600)
    try:
        ranked.train_step(groups)
    finally:
        ranked.stop("done")
    assert set(ranked.last_dropped) == {shares[0][0], shares[1][0]}
    assert ranked.last_dropped[shares[0][0]] == "episodes[0].reward: not finite"
    assert "follower rank" in ranked.last_dropped[shares[1][0]]
