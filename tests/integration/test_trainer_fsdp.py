"""The sharded learner (``learner.strategy=fsdp``, torch FSDP2 on CPU with gloo under torchrun):
two ranks running the multi-rank learner's share protocol take the same optimizer steps as
one process training on whole batches, hold about half the bytes of a replica each, publish
the same bytes as a replicated learner for the same weights, and resume exactly from their
sharded checkpoint.  One torchrun launch per algorithm (``fsdp_worker.py`` does the ranks'
part); GRPO with packing, seq-mean loss aggregation and a sharded KL reference model, and
PPO with its sharded critic and activation checkpointing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from turnscale.benchmarks.synthetic import build_tiny_model
from turnscale.learner import checkpoint, fsdp
from turnscale.learner.trainer import Trainer
from turnscale.learner.weights import WeightPublisher
from turnscale.protocol.transport import free_port
from tests.integration import fsdp_worker

ATOL = 2e-5
"""Weights after 3 AdamW steps (lr 1e-3): ranks reduce-scatter partial gradients, one process
sums them in another order; fp32 rounding differences stay ~1e-6 (the DDP test's bound is 1e-5)."""


def _run_ranks(tmp_path, model_dir: str, mode: str, ranks: int = 2) -> str:
    out = tmp_path / "out.pt"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "TMPDIR": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(os.path.dirname(__file__), "fsdp_worker.py"), model_dir,
           str(out), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return str(out)


def _publish(state: dict, dtype: str) -> tuple[bytes, list[int]]:
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.01, dtype=dtype, shm=False) as pub:
        manifest = pub.publish(1, state)
        return bytes(pub._versions[1].buf[:manifest.total_bytes]), [c.checksum for c in manifest.chunks]


@pytest.mark.parametrize("mode", ["grpo", "ppo"])
def test_fsdp_on_two_ranks_takes_the_steps_of_one_process_publishes_its_bytes_and_resumes_exactly(tmp_path, mode):
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=fsdp_worker.VOCAB, intermediate=64)
    got = torch.load(_run_ranks(tmp_path, model_dir, mode), weights_only=True)
    assert got["layers_sharded"] == 2 and got["checkpointing"] == (mode == "ppo")

    cfg = fsdp_worker.config(mode)
    cfg.learner.activation_checkpointing = False  # the reference keeps its activations
    single = Trainer(cfg, model_dir)  # one process: nothing to shard
    assert not single.sharded
    norms, after_two = [], None
    for i, groups in enumerate(fsdp_worker.batches()):
        m = single.train_step(groups)
        norms.append(m["loss/grad_norm"])
        if i == 1:
            after_two = single.state_dict_for_publish("float32")
    want = single.state_dict_for_publish("float32")

    # the same optimizer steps: the global gradient norm of each step, and the weights after 3
    assert got["norms"] == pytest.approx(norms, rel=1e-4), (got["norms"], norms)
    assert got["state"].keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got["state"][k], want[k], rtol=0, atol=ATOL, msg=k)

    # memory: a rank holds ~1/2 of a replica's parameters, gradients and AdamW state
    replica = fsdp.local_bytes(single.params, single.optimizer)
    for part in ("parameters", "gradients", "optimizer"):
        assert got["memory"][part] <= 0.55 * replica[part], (part, got["memory"], replica)
    # rank 0 takes the larger half of each odd split: what the plan counts from config.json
    assert fsdp.planned_state_bytes(model_dir, 2, value_head=mode == "ppo") == got["memory"]

    # publication: for the same weights, the bytes (and chunk checksums) of a replicated learner
    single._load_model_state(got["state"])
    ref_bytes, ref_sums = _publish(single.state_dict_for_publish(fsdp_worker.TRANSFER), fsdp_worker.TRANSFER)
    assert bytes(got["published"].numpy()) == ref_bytes
    assert got["checksums"] == ref_sums

    # exact resume from the sharded step-2 checkpoint on the same ranks ...
    assert got["resumed_at"] == 2
    assert got["resumed_norm"] == got["norms"][2]
    for k in want:
        assert torch.equal(got["resumed"][k], got["state"][k]), k

    # ... and onto another number of ranks: one process resumes it and takes the same step 3
    one = Trainer(cfg, model_dir)
    assert one.load_state(got["checkpoint"]) == 2
    one.train_step(fsdp_worker.batches()[2])
    resumed_on_one = one.state_dict_for_publish("float32")
    for k in want:
        torch.testing.assert_close(resumed_on_one[k], got["state"][k], rtol=0, atol=ATOL, msg=k)

    # the sharded checkpoint exported to HF format in one process holds the step-2 policy
    from turnscale.learner.export import main as export

    exported = str(tmp_path / "hf")
    assert export([os.path.dirname(got["checkpoint"]), exported]) == 0  # checkpoints/: the newest, step 2
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    for k, v in after_two.items():
        torch.testing.assert_close(hf[k], v, rtol=0, atol=ATOL, msg=k)


@pytest.mark.slow
def test_two_rank_fsdp_learner_publishes_the_weights_of_a_one_rank_learner_also_after_resume(tmp_path, monkeypatch):
    """``torchrun -m turnscale learner learner.strategy=fsdp`` end to end, fed by a scripted
    actor over ZeroMQ: publication through the service (version 0 and every step), a sharded
    checkpoint every step, and a resume from the newest one."""
    from tests.integration.test_learner_ranks import VOCAB, train

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torchrun's torchelastic_* folders

    fsdp_args = ("learner.strategy=fsdp", "learner.fsdp.param_dtype=float32")
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=VOCAB, intermediate=64)
    one = train(tmp_path, "one", model_dir, 1, 3)
    train(tmp_path, "two", model_dir, 2, 2, *fsdp_args)
    assert checkpoint.is_sharded(checkpoint.latest(str(tmp_path / "two" / "checkpoints")))
    two = train(tmp_path, "two-resumed", model_dir, 2, 3, "learner.resume=true", *fsdp_args)
    assert one.keys() == two.keys()
    for k in one:  # the bound of test_learner_ranks (DDP): float32 summation order only
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.slow
def test_each_of_four_fsdp_ranks_holds_under_a_third_of_a_replicas_training_state(tmp_path):
    """A 50M-parameter Qwen2-architecture model: after one optimizer step each of 4 ranks holds
    1/4 of every parameter, gradient and AdamW moment (plus each parameter's step counter and
    uneven last shards), counted from its local tensors; a replica (one DDP rank) holds all.
    The ranks compute in bfloat16 (``learner.fsdp.param_dtype``, the GPU default): the shards
    and the optimizer state stay float32, so the bytes are a quarter of the float32 replica's."""
    import json

    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=512, layers=12, heads=8, kv_heads=2, intermediate=1536,
                                 vocab=1000 * 32)
    out = _run_ranks(tmp_path, model_dir, "memory", ranks=4)
    cfg = fsdp_worker.config("grpo")
    cfg.algo.kl_coef = 0.0
    single = Trainer(cfg, model_dir)
    assert sum(p.numel() for p in single.params) >= 50_000_000
    single.train_step(fsdp_worker.memory_batch()[:1])
    replica = fsdp.local_bytes(single.params, single.optimizer)
    for rank in range(4):
        with open(f"{out}.{rank}.json") as f:
            held = json.load(f)
        for part in ("parameters", "gradients", "optimizer"):
            assert 0.24 * replica[part] <= held[part] <= 0.3 * replica[part], (rank, part, held, replica)
    # ... and the plan from config.json alone predicts both (the most loaded rank; a replica)
    assert fsdp.planned_state_bytes(model_dir, 4) == held  # every dimension splits evenly by 4 here
    assert fsdp.planned_state_bytes(model_dir, 4, strategy="ddp") == replica


@pytest.mark.slow
def test_sigterm_to_an_fsdp_torchrun_learner_writes_every_ranks_shards_and_stops_the_followers(tmp_path, monkeypatch):
    """scancel's SIGTERM: rank 0 finishes its step and checkpoints, which under FSDP has every
    follower (ignoring the signal) write its shards first; then the followers stop."""
    from tests.integration.scripted_actor import ScriptedActor
    from tests.integration.test_learner_ranks import VOCAB, end, learner_args, start_learner

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=VOCAB, intermediate=64)
    ports = [free_port() for _ in range(3)]
    log = str(tmp_path / "two.log")
    args = learner_args(str(tmp_path / "run"), model_dir, ports, 10, "learner.checkpoint_every=100",
                        "learner.strategy=fsdp", "learner.fsdp.param_dtype=float32")
    proc = start_learner(args, 2, log)
    actor = ScriptedActor(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", vocab=VOCAB)
    try:
        actor.hello()
        actor.feed(120, max_groups=4)  # one step
        actor.announcement(1)
        os.kill(proc.pid, signal.SIGTERM)  # what scancel does to the job's torchrun
        proc.wait(timeout=60)
    finally:
        actor.close()
        end(proc)
    text = open(log).read()
    step = tmp_path / "run" / "checkpoints" / "step-00000001"  # checkpoint_every=100: the signal's
    assert (step / "meta.json").is_file() and checkpoint.is_sharded(str(step)), text[-4000:]
    assert {p.name for p in step.iterdir()} >= {"rng-0.pt", "rng-1.pt", "trainer_state.pt"}, text[-4000:]
    assert len([p for p in (step / "sharded").iterdir() if p.suffix == ".distcp"]) == 2, text[-4000:]
    assert "learner rank 1 stops (done) at step 1" in text, text[-4000:]
