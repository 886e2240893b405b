"""The learner as one job of several ranks: ``torchrun --nproc_per_node=2 -m turnscale learner``
(gloo on 127.0.0.1, CPU) against the plain one-process learner, both fed the same groups by a
scripted actor over real ZeroMQ.  Rank 0 serves and splits each step's groups across the ranks;
the weights it publishes match the one-process learner's, also across a resume from a
checkpoint.  A follower rank that dies makes rank 0 exit with a clear error, not hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from turnscale.actors.weight_sync import pull_weights_blocking
from turnscale.benchmarks.synthetic import build_tiny_model
from turnscale.protocol.transport import free_port
from tests.integration.scripted_actor import ScriptedActor

VOCAB = 256


def learner_args(run_dir: str, model_dir: str, ports: list[int], steps: int, *extra: str) -> list[str]:
    return [f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
            f"learner.init_from={model_dir}", f"learner.dir={run_dir}", f"learner.steps={steps}", "learner.groups_per_step=4",
            "algo.group_size=4", "learner.max_staleness=0", "learner.checkpoint_every=1", "learner.save_trajectories=false",
            "learner.heartbeat_interval_s=30", "learner.rank_timeout_s=60", "algo.lr=1e-3",
            # small micro-batches: the ranks' shares plan different micro-batch counts (padded)
            "algo.micro_batch_tokens=80", "logger.tensorboard=false", "logger.console_every_s=0", *extra]


def start_learner(args: list[str], ranks: int, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    if ranks == 1:
        cmd = [sys.executable, "-m", "turnscale", "learner", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "turnscale", "learner", *args]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks (their own session)
        proc.wait(timeout=10)


def train(tmp_path, name: str, model_dir: str, ranks: int, steps: int, *extra: str) -> dict[str, torch.Tensor]:
    """Run a learner to ``steps`` on scripted groups; the weights it published last."""
    ports = [free_port() for _ in range(3)]
    log = str(tmp_path / f"{name}.log")
    proc = start_learner(learner_args(str(tmp_path / name.split("-")[0]), model_dir, ports, steps, *extra), ranks, log)
    actor = ScriptedActor(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", vocab=VOCAB)
    try:
        w = actor.hello()
        actor.feed(240)
        ann = actor.announcement(steps)
        weights = pull_weights_blocking(w.weights_endpoint, ann.manifest, timeout_s=30, copy=True)
        actor.goodbye()
        assert proc.wait(timeout=120) == 0, open(log).read()[-4000:]
    finally:
        actor.close()
        end(proc)
    text = open(log).read()
    if ranks > 1:
        assert f"learner rank 0 of {ranks}" in text and "learner rank 1 stops (done)" in text, text[-4000:]
    return weights


@pytest.mark.slow
def test_two_rank_learner_publishes_the_weights_of_a_one_rank_learner_also_after_resume(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=VOCAB, intermediate=64)
    one = train(tmp_path, "one", model_dir, 1, 3)
    train(tmp_path, "two", model_dir, 2, 2)
    two = train(tmp_path, "two-resumed", model_dir, 2, 3, "learner.resume=true")
    metrics = [line for line in open(tmp_path / "two" / "metrics.jsonl")]
    assert len(metrics) == 3 and all('"perf/learner_ranks": 2.0' in line for line in metrics), metrics
    assert one.keys() == two.keys()
    # Same groups, same steps: the sums of gradients differ only in float32 summation order
    # (two ranks' partial sums all-reduced vs one sum), ~1e-7 relative; Adam's update per
    # step is ~lr=1e-3 in size, so 3 steps differ by far less than 1e-5.  A wrong split
    # (a group trained twice or not at all, a rank's normaliser) moves weights by ~1e-3.
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.slow
def test_rank_0_exits_with_a_clear_error_when_a_follower_rank_dies(tmp_path):
    """The ranks are started by hand (RANK/WORLD_SIZE as torchrun sets them) so that no
    launcher ends rank 0 for us: rank 0 itself notices the dead follower."""
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=VOCAB, intermediate=64)
    ports = [free_port() for _ in range(3)]
    args = learner_args(str(tmp_path / "run"), model_dir, ports, 10, "learner.rank_timeout_s=20")
    dist_port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(dist_port), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2"}
            procs.append(subprocess.Popen([sys.executable, "-m", "turnscale", "learner", *args], env=env,
                                          stdout=open(tmp_path / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT))
        actor = ScriptedActor(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", vocab=VOCAB)
        try:
            actor.hello()
            actor.feed(120, max_groups=4)  # one step on both ranks
            actor.announcement(1)
        finally:
            actor.close()
        procs[1].kill()
        procs[1].wait(timeout=10)
        t0 = time.monotonic()
        code = procs[0].wait(timeout=60)  # pings every rank_timeout_s / 4 = 5 s; a send to a dead peer fails
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    log = open(tmp_path / "rank0.log").read()
    assert code == 1, log[-3000:]
    assert "turnscale learner: learner rank 1 failed" in log and "learner.resume=true" in log, log[-3000:]
    assert took < 45, took


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_on_rank_0_and_stops_the_followers(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=VOCAB, intermediate=64)
    ports = [free_port() for _ in range(3)]
    log = str(tmp_path / "two.log")
    args = learner_args(str(tmp_path / "run"), model_dir, ports, 10, "learner.checkpoint_every=100")
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
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir(), text[-4000:]  # checkpoint_every=100: the signal's
    assert "learner rank 1 stops (done) at step 1" in text, text[-4000:]
