"""Trainer on a tiny randomly initialised model (CPU): steps, micro-batching, checkpoints."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from turnscale.conf.schema import Config
from turnscale.learner import checkpoint as ckpt
from turnscale.learner.logprobs import token_logprobs_BT
from turnscale.learner.main import TrainerCheckpointer
from turnscale.learner.schedule import TurnSchedule
from turnscale.benchmarks.synthetic import build_tiny_model, synthetic_groups
from turnscale.learner.trainer import Trainer, lr_factor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), hidden=32, layers=2, vocab=256, intermediate=64)


def make_cfg(algo="grpo", **algo_kw):
    cfg = Config()
    cfg.algo.name = algo
    cfg.algo.lr = 1e-3
    for k, v in algo_kw.items():
        setattr(cfg.algo, k, v)
    cfg.learner.steps = 5
    return cfg


def batches(n, seed=0):
    return [synthetic_groups(2, 4, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=5, seed=seed + i) for i in range(n)]


def params(trainer):
    sd = {k: v.detach().clone() for k, v in trainer.hf_model.state_dict().items()}
    if trainer.value_head is not None:
        sd.update({f"value_head.{k}": v.detach().clone() for k, v in trainer.value_head.state_dict().items()})
    return sd


def assert_same(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def save(trainer, root, *, schedule=None, extra=None, keep=2):
    """A checkpoint of ``trainer`` as the learner writes it: the trainer's part plus the run's state."""
    return TrainerCheckpointer(trainer, str(root), schedule, keep).save(trainer.step, dict(extra or {}))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_resume_after_three_steps_then_two_equals_five_straight(model_dir, tmp_path, algo):
    data = batches(5)
    kw = dict(warmup_steps=2, lr_schedule="cosine")
    straight = Trainer(make_cfg(algo, **kw), model_dir)
    for b in data:
        straight.train_step(b)

    first = Trainer(make_cfg(algo, **kw), model_dir)
    for b in data[:3]:
        first.train_step(b)
    sched = TurnSchedule(turns=[4, 8], every=3)
    path = save(first, tmp_path, schedule=sched, extra={"cursor": 7, "version": 3})
    del first

    resumed = Trainer(make_cfg(algo, **kw), model_dir)
    extra = TrainerCheckpointer(resumed, str(tmp_path), sched, 2).load_latest()
    assert ckpt.latest(str(tmp_path)) == path and resumed.step == 3 and extra == {"cursor": 7, "version": 3}
    assert sched.check_resume(ckpt.load_meta(path).schedule, resumed.step) == 1
    for b in data[3:]:
        resumed.train_step(b)
    assert resumed.step == straight.step == 5
    assert_same(params(resumed), params(straight))
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()


def test_the_trainer_writes_only_model_optimizer_and_rng_state(model_dir, tmp_path):
    """The run's state (schedule, ``extra``) is the checkpointer's, in ``meta.json`` beside the
    trainer's files; the trainer's ``trainer_state.pt`` holds its own state only."""
    tr = Trainer(make_cfg("ppo"), model_dir)
    tr.train_step(batches(1)[0])
    part = tmp_path / "part"
    part.mkdir()
    tr.state_writer()(str(part))
    assert sorted(os.listdir(part)) == ["model", "modules.safetensors", "trainer_state.pt"]
    state = torch.load(part / "trainer_state.pt", weights_only=True)
    assert sorted(state) == ["optimizer", "rng", "scheduler", "step"] and state["step"] == 1
    path = save(tr, tmp_path / "ck", schedule=TurnSchedule(turns=[4, 8], every=3), extra={"version": 1})
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    assert meta == {"format": ckpt.FORMAT, "step": 1, "schedule": meta["schedule"], "extra": {"version": 1}} and meta["schedule"]


def test_a_checkpoint_in_the_previous_layout_still_resumes(model_dir, tmp_path):
    """Format 1: the trainer's step was only in ``meta.json`` (``trainer_state.pt`` had none)."""
    data = batches(3)
    tr = Trainer(make_cfg(), model_dir)
    for b in data[:2]:
        tr.train_step(b)
    path = save(tr, tmp_path, extra={"version": 2, "cursor": 5})
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    del state["step"]
    torch.save(state, os.path.join(path, "trainer_state.pt"))
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({**meta, "format": 1}, f)

    again = Trainer(make_cfg(), model_dir)
    assert TrainerCheckpointer(again, str(tmp_path), None, 2).load_latest() == {"version": 2, "cursor": 5}
    assert again.step == 2
    assert_same(params(again), params(tr))
    tr.train_step(data[2])
    again.train_step(data[2])
    assert_same(params(again), params(tr))


def test_resume_refuses_a_trainer_step_that_disagrees_with_the_run_state(model_dir, tmp_path):
    tr = Trainer(make_cfg(), model_dir)
    tr.train_step(batches(1)[0])
    path = save(tr, tmp_path)
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({**meta, "step": 7}, f)
    with pytest.raises(ckpt.CheckpointError, match="step 7"):
        TrainerCheckpointer(Trainer(make_cfg(), model_dir), str(tmp_path), None, 2).load_latest()


def test_checkpoints_keep_the_last_n_and_latest_ignores_incomplete_ones(model_dir, tmp_path):
    tr = Trainer(make_cfg(), model_dir)
    for b in batches(3):
        tr.train_step(b)
        save(tr, tmp_path, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 3]
    os.makedirs(tmp_path / "step-00000009")  # a crash mid-write would look like this (no meta.json)
    os.makedirs(tmp_path / ".tmp-step-00000010-abc")
    assert ckpt.latest(str(tmp_path)).endswith("step-00000003")
    with pytest.raises(ckpt.CheckpointError, match="meta.json"):
        tr.load_state(str(tmp_path / "step-00000009"))
    with pytest.raises(TypeError):
        save(tr, tmp_path, extra={"not json": object()})
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == [2, 3]


def test_a_failure_while_the_trainer_writes_its_part_leaves_no_checkpoint(model_dir, tmp_path):
    tr = Trainer(make_cfg(), model_dir)
    tr.train_step(batches(1)[0])
    write = tr.state_writer()

    def crash(path):
        write(path)  # the trainer's part is complete, the run's state not yet written
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.save(str(tmp_path), step=tr.step, write_trainer=crash, extra={"version": 1})
    assert ckpt.latest(str(tmp_path)) is None and os.listdir(tmp_path) == []


def test_checkpoint_model_folder_is_a_loadable_hf_model(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    tr = Trainer(make_cfg(), model_dir)
    tr.train_step(batches(1)[0])
    path = save(tr, tmp_path)
    again = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"))
    assert_same({k: v for k, v in again.state_dict().items()}, dict(tr.hf_model.state_dict()))


@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce_pp"])
def test_micro_batching_gives_the_same_step_as_one_batch(model_dir, algo):
    data = batches(1)[0]
    big = Trainer(make_cfg(algo, micro_batch_tokens=100_000), model_dir)
    small = Trainer(make_cfg(algo, micro_batch_tokens=60), model_dir)
    m_big, m_small = big.train_step(data), small.train_step(data)
    assert m_big["perf/micro_batches"] == 1 and m_small["perf/micro_batches"] > 3
    assert m_small["loss/policy_loss"] == pytest.approx(m_big["loss/policy_loss"], rel=1e-5)
    # same gradient up to float summation order; Adam's first step (~lr * sign(g)) amplifies
    # that noise on components whose gradient is near 0, hence 2% of lr
    assert m_small["loss/grad_norm"] == pytest.approx(m_big["loss/grad_norm"], rel=1e-5)
    assert_same(params(big), params(small), atol=2e-5)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_extra_proximal_forward_gives_the_same_step(model_dir, algo):
    data = batches(2)
    a = Trainer(make_cfg(algo, micro_batch_tokens=80, prox_forward="auto"), model_dir)
    b = Trainer(make_cfg(algo, micro_batch_tokens=80, prox_forward="extra"), model_dir)
    for d in data:
        ma, mb = a.train_step(d), b.train_step(d)
    assert ma["loss/behaviour_weight_mean"] == pytest.approx(mb["loss/behaviour_weight_mean"], rel=1e-6)
    assert_same(params(a), params(b), atol=2e-5)


def test_grpo_steps_raise_the_likelihood_of_rewarded_episodes(model_dir):
    tr = Trainer(make_cfg(lr=3e-3), model_dir)
    groups = batches(1)[0]

    def mean_logp(reward):
        eps = [ep for g in groups for ep in g.episodes if ep.reward == reward]
        out = []
        with torch.no_grad():
            for ep in eps:
                ids = torch.from_numpy(ep.token_ids.astype(np.int64))[None]
                lp = token_logprobs_BT(tr.hf_model(input_ids=ids).logits, ids)[0].numpy()
                out.append(lp[ep.loss_mask > 0].mean())
        return float(np.mean(out))

    before = mean_logp(1.0) - mean_logp(0.0)
    for _ in range(5):
        tr.train_step(groups)
    assert mean_logp(1.0) - mean_logp(0.0) > before + 0.05


def test_equal_reward_groups_are_counted_and_give_no_gradient(model_dir):
    groups = batches(1)[0]
    for g in groups:
        for ep in g.episodes:
            object.__setattr__(ep, "reward", 1.0)
    tr = Trainer(make_cfg(), model_dir)
    before = params(tr)
    m = tr.train_step(groups)
    assert m["loss/degenerate_groups"] == 2 and m["loss/grad_norm"] == 0.0
    assert_same(params(tr), before, atol=0)


def test_failed_groups_are_rejected(model_dir):
    from turnscale.protocol.messages import TrajectoryGroup

    g = batches(1)[0][0]
    bad = TrajectoryGroup(lease_id="x", actor_id="a", task=g.task, turn_limit=g.turn_limit, episodes=[], failed=True, error="env down")
    with pytest.raises(ValueError, match="failed"):
        Trainer(make_cfg(), model_dir).train_step([bad])


def test_sft_steps_lower_the_nll_of_the_assistant_tokens(model_dir):
    tr = Trainer(make_cfg("sft", lr=1e-2), model_dir)
    groups = batches(1)[0]
    first = tr.train_step(groups)["loss/sft_nll"]
    for _ in range(4):
        last = tr.train_step(groups)["loss/sft_nll"]
    assert last < first - 0.1


def test_kl_to_reference_starts_at_zero_and_grows(model_dir):
    tr = Trainer(make_cfg(kl_coef=0.1), model_dir)
    assert tr.ref_model is not None
    data = batches(4)
    assert tr.train_step(data[0])["loss/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    for d in data[1:]:
        m = tr.train_step(d)
    assert m["loss/kl_ref"] > 0


def test_state_dict_for_publish_is_a_cast_cpu_copy_with_hf_names(model_dir):
    tr = Trainer(make_cfg(), model_dir)
    sd = tr.state_dict_for_publish("bfloat16")
    live = tr.hf_model.state_dict()
    assert list(sd) == list(live)
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in sd.values())
    sd32 = tr.state_dict_for_publish("float32")
    name = next(iter(sd32))
    sd32[name].zero_()
    assert live[name].abs().sum() > 0  # a copy, not the live parameter
    with pytest.raises(ValueError, match="transfer dtype"):
        tr.state_dict_for_publish("int8")


def test_lr_warms_up_then_follows_its_schedule():
    assert [lr_factor(s, warmup=2, total=6, kind="constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, warmup=2, total=6, kind="cosine") for s in range(2, 7)]
    assert cos[0] == 1.0 and cos[2] == pytest.approx(0.5) and cos[-1] == pytest.approx(0.0, abs=1e-12)


def test_logprobs_follow_the_shared_convention():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 9)
    ids = torch.randint(0, 9, (2, 4))
    got = token_logprobs_BT(logits, ids, temperature=0.7)
    want = torch.zeros(2, 4)
    for b in range(2):
        for t in range(1, 4):
            want[b, t] = torch.log_softmax(logits[b, t - 1] / 0.7, -1)[ids[b, t]]
    torch.testing.assert_close(got, want)


def test_fused_logprobs_and_entropy_match_the_reference_functions():
    from turnscale.learner.logprobs import logprobs_and_entropy_BT, token_entropy_BT

    torch.manual_seed(1)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 1, 1, 0]])
    lp, ent = logprobs_and_entropy_BT(logits, ids, 1.3, entropy_mask_BT=mask, entropy_grad=True)
    torch.testing.assert_close(lp, token_logprobs_BT(logits, ids, 1.3))
    torch.testing.assert_close(ent, token_entropy_BT(logits, 1.3) * mask)
    ent.sum().backward()
    assert logits.grad.abs().sum() > 0
    _, ent_nograd = logprobs_and_entropy_BT(logits, ids, 1.3, entropy_mask_BT=mask)
    assert not ent_nograd.requires_grad


def test_learner_logprobs_equal_the_actor_convention():
    from turnscale.common.logprobs import token_logprobs

    torch.manual_seed(2)
    logits = torch.randn(3, 6, 13)
    ids = torch.randint(0, 13, (3, 6))
    torch.testing.assert_close(token_logprobs_BT(logits, ids, 0.8)[:, 1:], token_logprobs(logits[:, :-1], ids[:, 1:], 0.8),
                               rtol=0, atol=0)


def test_unknown_devices_are_rejected_with_the_choices():
    from turnscale.learner.trainer import make_accelerator

    with pytest.raises(ValueError, match="cpu, cuda"):
        make_accelerator("tpu", "float32")


@pytest.mark.gpu
def test_training_on_cuda_with_bf16_mixed_precision(model_dir):
    cfg = make_cfg("ppo", kl_coef=0.01)
    cfg.learner.device = "cuda"
    cfg.model.dtype = "bfloat16"
    tr = Trainer(cfg, model_dir)
    assert tr.device.type == "cuda" and tr.accelerator.mixed_precision == "bf16"
    for b in batches(2):
        m = tr.train_step(b)
    assert tr.step == 2 and np.isfinite(m["loss/policy_loss"]) and np.isfinite(m["loss/value"])
    sd = tr.state_dict_for_publish("bfloat16")
    assert all(v.device.type == "cpu" and v.dtype == torch.bfloat16 for v in sd.values())


def test_bf16_mixed_precision_on_cpu_trains(model_dir):
    cfg = make_cfg()
    cfg.model.dtype = "bfloat16"
    tr = Trainer(cfg, model_dir)
    assert tr.accelerator.mixed_precision == "bf16"
    before = params(tr)
    m = tr.train_step(batches(1)[0])
    assert np.isfinite(m["loss/policy_loss"]) and tr.step == 1
    assert next(iter(tr.hf_model.parameters())).dtype == torch.float32  # fp32 master weights
    assert any(not torch.equal(before[k], v) for k, v in params(tr).items())
    fp32 = Trainer(make_cfg(), model_dir)  # back to fp32 in the same process
    assert fp32.accelerator.mixed_precision == "no"


def test_rng_states_round_trip():
    import random

    state = ckpt.capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def test_seq_mean_token_mean_gives_every_episode_the_same_weight_whatever_its_length(model_dir):
    from turnscale.learner.trainer import _Row

    tr = Trainer(make_cfg(loss_agg="seq_mean_token_mean"), model_dir)
    rows = []
    for n, a in ((2, 1.0), (6, -1.0), (4, 0.5)):
        mask = np.ones(n, dtype=np.float32)
        rows.append(_Row(ids=np.zeros(n, dtype=np.int64), mask=mask, mu=np.zeros(n, dtype=np.float32), reward=a, truncated=False, group=0, index=0))
        rows[-1].adv = a * mask
    mean_len = 4.0  # (2 + 6 + 4) / 3: the step's mean over all ranks, handed in by train_step
    tr._aggregate(rows, mean_len)
    # token-mean over the batch = sum(adv) / (3 * mean_len) = mean over episodes of A_i
    for r, a in zip(rows, (1.0, -1.0, 0.5)):
        assert float(r.adv.sum()) == pytest.approx(a * mean_len)
    tr_plain = Trainer(make_cfg(), model_dir)
    plain = [_Row(ids=np.zeros(3, dtype=np.int64), mask=np.ones(3, dtype=np.float32), mu=np.zeros(3, dtype=np.float32), reward=1.0, truncated=False, group=0, index=0)]
    plain[0].adv = np.ones(3)
    tr_plain._aggregate(plain, 3.0)
    assert plain[0].adv.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights(model_dir, algo):
    """A NaN reward (had it slipped past intake) makes the loss NaN: the trainer refuses the
    step — no optimizer update, no LR step, ``step`` unchanged — and the next good batch
    trains as if the bad one never came."""
    from dataclasses import replace as dc_replace

    good = batches(2)
    ref = Trainer(make_cfg(algo), model_dir)
    ref.train_step(good[0])

    t = Trainer(make_cfg(algo), model_dir)
    before = params(t)
    bad = [dc_replace(g, episodes=[dc_replace(ep, reward=float("nan")) for ep in g.episodes]) for g in good[1]]
    out = t.train_step(bad)
    assert out["train/nonfinite"] == 1.0 and t.step == 0
    assert_same(params(t), before, atol=0)
    t.train_step(good[0])
    assert t.step == 1
    assert_same(params(t), params(ref))


# ----------------------------------------------------------------------------- one group cannot cost everyone a step


def _with_reward(group, reward):
    from dataclasses import replace as dc_replace

    return dc_replace(group, episodes=[dc_replace(ep, reward=reward) if k == 0 else ep for k, ep in enumerate(group.episodes)])


@pytest.mark.parametrize("algo,reward", [("grpo", 1e300), ("grpo", float("nan")), ("ppo", 1e300), ("rloo", float("inf"))])
def test_a_group_with_an_unusable_reward_is_dropped_and_the_others_train(model_dir, algo, reward):
    """Had it slipped past intake, one group whose reward breaks the statistics costs only
    itself: the step trains the other group exactly as if it had come alone."""
    good, other = batches(1)[0]
    ref = Trainer(make_cfg(algo), model_dir)
    ref.train_step([good])

    t = Trainer(make_cfg(algo), model_dir)
    out = t.train_step([good, _with_reward(other, reward)])
    assert t.step == 1 and "train/nonfinite" not in out
    assert list(t.last_dropped) == [1] and "rewards" in t.last_dropped[1]
    assert all(np.isfinite(v) for v in out.values())
    assert_same(params(t), params(ref))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_group_whose_new_logprobs_are_not_finite_is_dropped_before_the_update_and_the_rest_train(model_dir, algo):
    """Found in the forward (row by row, before backward): the gradients are discarded and
    the step runs again without that group, once; the result equals the good group alone."""
    good, other = batches(1)[0]
    ref = Trainer(make_cfg(algo), model_dir)
    ref.train_step([good])

    t = Trainer(make_cfg(algo), model_dir)
    forward = t._forward

    def poisoned(rows, micro, **kw):
        logp, ent, values, boot = forward(rows, micro, **kw)
        bad = torch.tensor([r.group == 1 for r in rows])[:, None]
        return logp + torch.where(bad, float("nan"), 0.0), ent, values, boot

    t._forward = poisoned
    out = t.train_step([good, other])
    assert t.step == 1 and "train/nonfinite" not in out
    assert t.last_dropped == {1: "new log-probs"}
    assert_same(params(t), params(ref))


def test_a_non_finite_gradient_with_no_group_to_blame_still_skips_the_whole_step(model_dir):
    t = Trainer(make_cfg(), model_dir)
    before = params(t)
    p = next(iter(t.hf_model.parameters()))
    handle = p.register_hook(lambda g: g * float("nan"))
    out = t.train_step(batches(1)[0])
    handle.remove()
    assert out["train/nonfinite"] == 1.0 and t.step == 0 and t.last_dropped == {}
    assert_same(params(t), before, atol=0)


def test_logprobs_off_the_loss_mask_are_never_read(model_dir):
    """A NaN behaviour log-prob on a prompt or observation token changes nothing: not the
    metrics (the behaviour KL used to turn NaN), not the step."""
    from dataclasses import replace as dc_replace

    data = batches(1)[0]

    def nan_off_mask(ep):
        lps = ep.logprobs.copy()
        lps[np.flatnonzero(ep.loss_mask == 0)] = np.nan
        return dc_replace(ep, logprobs=lps)

    dirty = [dc_replace(g, episodes=[nan_off_mask(ep) for ep in g.episodes]) for g in data]
    ref, t = Trainer(make_cfg(), model_dir), Trainer(make_cfg(), model_dir)
    clean_out, out = ref.train_step(data), t.train_step(dirty)
    assert t.step == 1 and t.last_dropped == {}
    assert all(np.isfinite(v) for v in out.values())
    assert out["loss/kl_behaviour"] == clean_out["loss/kl_behaviour"]
    assert_same(params(t), params(ref), atol=0)
