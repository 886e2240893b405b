"""Semantically bad groups sent by a real actor socket to a real learner process.

Every group below decodes (the codec accepts it) and answers a real lease, but would
crash the train step or poison it: token ids outside the vocabulary (also in the
prompt), non-finite rewards or log-probs, positive log-probs, an episode longer than the
context, a loss mask on prompt tokens, versions in the future.  The learner must stay up,
drop each as ``invalid`` (naming the field and the actor in one log line), re-issue its
task, and keep training on the good groups.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest
import trio
import zmq

from protocol.messages import GroupAck, Hello, LeaseGrant, LeaseRequest, TrajectoryGroup, Welcome
from protocol.transport import AsyncSocket, Requester, configure, free_port
from tests.unit.fakes import make_episode
from turnscale.procs import ProcessGroup

VOCAB = 1024
CONTEXT = 256


def _bad_episodes(ep, version):
    """name -> a copy of ``ep`` with one semantic defect."""
    ids_over = ep.token_ids.copy()
    ids_over[-3] = VOCAB + 7
    ids_neg_prompt = ep.token_ids.copy()
    ids_neg_prompt[0] = -1
    lp_inf = ep.logprobs.copy()
    lp_inf[np.flatnonzero(ep.loss_mask)[0]] = -np.inf
    lp_pos = ep.logprobs.copy()
    lp_pos[np.flatnonzero(ep.loss_mask)[0]] = 0.5
    lp_nan = ep.logprobs.copy()
    lp_nan[np.flatnonzero(ep.loss_mask)[1]] = np.nan
    mask_prompt = ep.loss_mask.copy()
    mask_prompt[1] = 1
    vers_future = ep.versions.copy()
    vers_future[np.flatnonzero(ep.loss_mask)[0]] = version + 5
    n = CONTEXT + 40
    long = make_episode(version=version, turns=1, tokens_per_turn=n - 6, obs_tokens=2)
    return {
        "token id over the vocabulary": ("token_ids", replace(ep, token_ids=ids_over)),
        "prompt token id -1": ("token_ids", replace(ep, token_ids=ids_neg_prompt)),
        "NaN reward": ("reward", replace(ep, reward=float("nan"))),
        "inf reward": ("reward", replace(ep, reward=float("inf"))),
        "-inf log-prob": ("logprobs", replace(ep, logprobs=lp_inf)),
        "NaN log-prob": ("logprobs", replace(ep, logprobs=lp_nan)),
        "positive log-prob": ("logprobs", replace(ep, logprobs=lp_pos)),
        "longer than the context": ("token_ids", long),
        "loss mask on a prompt token": ("loss_mask", replace(ep, loss_mask=mask_prompt)),
        "version in the future": ("versions", replace(ep, versions=vers_future)),
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_learner_drops_each_semantically_bad_group_as_invalid_and_keeps_training(tmp_path, tiny_model_dir):
    ports = [free_port() for _ in range(3)]
    run_dir = tmp_path / "learner"
    procs = ProcessGroup(tmp_path / "logs")
    learner = procs.start("learner", [
        "learner", f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
        f"model.path={tiny_model_dir}", f"learner.dir={run_dir}", "learner.steps=2", "learner.groups_per_step=1",
        "algo.group_size=2", "learner.max_staleness=0", f"sampling.max_context_tokens={CONTEXT}",
        "logger.tensorboard=false", "logger.console_every_s=0", "learner.heartbeat_interval_s=1"])
    ctx = zmq.Context()
    actor_id = "hostile-actor-7"

    async def act():
        sock = AsyncSocket(configure(ctx.socket(zmq.DEALER)))
        sock.sock.connect(f"tcp://127.0.0.1:{ports[0]}")
        req = Requester(sock)
        with trio.fail_after(150):
            while True:  # the learner takes a few seconds to load the model
                try:
                    welcome = await req.request(Hello(actor_id=actor_id, host="h", pid=1, engine="fake", device="cpu",
                                                      max_groups=1), timeout_s=2)
                    break
                except Exception:
                    assert learner.alive(), learner.tail()
                    await trio.sleep(0.5)
            assert isinstance(welcome, Welcome)

            async def lease():
                while True:
                    g = await req.request(LeaseRequest(actor_id=actor_id, max_leases=1), timeout_s=10)
                    assert isinstance(g, LeaseGrant)
                    if g.leases:
                        return g.leases[0]
                    await trio.sleep(0.05)

            acks = {}
            good = make_episode(version=0, turn_limit=0)
            for name, (field, bad) in _bad_episodes(good, 0).items():
                l_ = await lease()
                eps = [replace(good, turn_limit=l_.turn_limit), replace(bad, turn_limit=l_.turn_limit)]
                group = TrajectoryGroup(lease_id=l_.lease_id, actor_id=actor_id, task=l_.task, turn_limit=l_.turn_limit,
                                        episodes=eps)
                ack = await req.request(group, timeout_s=10)
                assert isinstance(ack, GroupAck)
                acks[name] = (field, ack, l_.task)
                assert learner.alive(), learner.tail()
            trained = []
            for _ in range(2):  # good groups: two steps
                l_ = await lease()
                eps = [replace(make_episode(version=l_.policy_version, reward=float(i)), turn_limit=l_.turn_limit)
                       for i in range(2)]
                ack = await req.request(TrajectoryGroup(lease_id=l_.lease_id, actor_id=actor_id, task=l_.task,
                                                        turn_limit=l_.turn_limit, episodes=eps), timeout_s=10)
                assert ack.accepted, ack
                trained.append(l_.task)
            sock.close()
            return acks, trained

    try:
        acks, trained = trio.run(act)
        for name, (field, ack, _) in acks.items():
            assert (ack.accepted, ack.reason) == (False, "invalid"), name
        # the first good lease re-issues the first bad group's task (invalid groups' tasks go back)
        assert trained[0] == next(iter(acks.values()))[2]
        deadline = time.monotonic() + 120
        while learner.alive() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert learner.popen.returncode == 0, learner.tail(40)  # trained both steps and shut down cleanly
        log = learner.log_path.read_text(errors="replace")
        for name, (field, _, _) in acks.items():
            assert f"from actor {actor_id} dropped as invalid: episodes[1].{field}" in log, (name, field)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert sum(r.get("rollout/dropped/invalid", 0) for r in rows) == len(acks)
        assert "Traceback" not in log
    finally:
        ctx.destroy(linger=0)
        procs.close(grace_s=8)
