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

from turnscale.protocol import codec
from turnscale.protocol.messages import GroupAck, Hello, LeaseGrant, LeaseRequest, TrajectoryGroup, Welcome
from turnscale.protocol.transport import AsyncSocket, Requester, configure, free_port
from tests.integration.test_failures import rss_mb
from tests.unit.fakes import make_episode, make_group
from turnscale.common.procs import ProcessGroup

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
    lp_nan_prompt = ep.logprobs.copy()
    lp_nan_prompt[0] = np.nan  # not a sampled token: unused, but refused like any non-finite value
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
        "reward 1e300 (over learner.max_abs_reward)": ("reward", replace(ep, reward=1e300)),
        "NaN log-prob on a prompt token": ("logprobs", replace(ep, logprobs=lp_nan_prompt)),
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
    procs = ProcessGroup(tmp_path / "logs", "turnscale")
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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_learner_binds_actor_ids_to_connections_and_bounds_what_one_client_can_take(tmp_path, tiny_model_dir):
    """Hostile clients against a real learner process: impersonated Hello and Goodbye, a
    forged group for another actor's lease, lease hoarding (with the default lease settings),
    a second actor id on the hoarder's connection, huge ids, an oversize multipart message.
    The real actor's leases survive every attack, its group is accepted and it still gets a
    lease while the hoarder asks for 10^6; the learner stays up and bounded."""
    from turnscale.protocol.messages import Goodbye, Heartbeat, HeartbeatAck

    ports = [free_port() for _ in range(3)]
    procs = ProcessGroup(tmp_path / "logs", "turnscale")
    learner = procs.start("learner", [
        "learner", f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
        f"model.path={tiny_model_dir}", f"learner.dir={tmp_path / 'learner'}", "learner.steps=1000",
        "algo.group_size=2", "learner.max_message_mb=1",  # every lease setting at its default; 1 MiB frames below
        "logger.tensorboard=false", "logger.console_every_s=0", "learner.heartbeat_interval_s=5"])
    ctx = zmq.Context()
    out = {}

    def conn():
        s = AsyncSocket(configure(ctx.socket(zmq.DEALER)))
        s.sock.connect(f"tcp://127.0.0.1:{ports[0]}")
        return Requester(s)

    async def ask(req, msg):
        try:
            return await req.request(msg, timeout_s=20)
        except Exception as exc:  # ErrorReply arrives as RemoteError
            return exc

    def hello(actor_id, token, max_groups=2):
        return Hello(actor_id=actor_id, host="h", pid=1, engine="fake", device="cpu", max_groups=max_groups, token=token)

    async def attack():
        real, evil = conn(), conn()
        with trio.fail_after(150):
            while not isinstance(await ask(real, hello("real", "t-real")), Welcome):
                assert learner.alive(), learner.tail()
                await trio.sleep(0.5)
            leases = (await ask(real, LeaseRequest(actor_id="real", max_leases=2))).leases
            assert len(leases) == 2
            out["hello_takeover"] = await ask(evil, hello("real", "t-evil"))
            out["goodbye"] = await ask(evil, Goodbye(actor_id="real", reason="forged"))
            out["heartbeat_as_real"] = await ask(evil, Heartbeat(actor_id="real", lease_ids=[], policy_version=0))
            assert isinstance(await ask(evil, hello("evil", "t-evil", max_groups=1000)), Welcome)
            forged = TrajectoryGroup(lease_id=leases[0].lease_id, actor_id="evil", task=leases[0].task,
                                     turn_limit=leases[0].turn_limit,
                                     episodes=[replace(make_episode(version=0), turn_limit=leases[0].turn_limit)] * 2)
            out["forged_group"] = await ask(evil, forged)
            out["forged_as_real"] = await ask(evil, replace(forged, actor_id="real"))
            out["hoard"] = await ask(evil, LeaseRequest(actor_id="evil", max_leases=1_000_000))
            out["second_id"] = await ask(evil, hello("evil-2", "t-evil", max_groups=1000))  # a second share? no
            hb = await ask(real, Heartbeat(actor_id="real", lease_ids=[l.lease_id for l in leases], policy_version=0))
            out["real_heartbeat"] = hb
            real_group = replace(forged, actor_id="real")
            out["real_group"] = await ask(real, real_group)
            out["real_again"] = await ask(real, LeaseRequest(actor_id="real", max_leases=1))  # during the attack
            out["hoard_again"] = await ask(evil, LeaseRequest(actor_id="evil", max_leases=1_000_000))
            # huge ids (512 KB, under the 1 MiB frame limit): refused, never stored, logs bounded
            rss0, log0 = rss_mb(learner.pid), learner.log_path.stat().st_size
            for i in range(100):
                r = await ask(conn(), hello(f"{i}-" + "x" * (1 << 19), "t"))
                assert not isinstance(r, Welcome)
            out["huge_id_reply"] = r
            out["huge_ids"] = (rss0, rss_mb(learner.pid), learner.log_path.stat().st_size - log0)
            # a frame over the limit: ZeroMQ drops that connection before the learner sees it
            dropped = conn()
            try:
                out["over_frame"] = await dropped.request(hello("y" * (2 << 20), "t"), timeout_s=3)
            except Exception as exc:
                out["over_frame"] = exc
            # an oversize multipart message (three frames, each under the per-frame limit)
            raw = ctx.socket(zmq.DEALER)
            raw.connect(f"tcp://127.0.0.1:{ports[0]}")
            big = [b"rid00001", b"\x00" * 900_000, b"\x00" * 900_000, b"\x00" * 900_000]
            raw.send_multipart(big)
            with trio.fail_after(30):
                while not raw.poll(0):
                    await trio.sleep(0.05)
            out["oversize"] = codec.decode(raw.recv_multipart()[1:])
            raw.close(0)
            out["after"] = await ask(real, Heartbeat(actor_id="real", lease_ids=[leases[1].lease_id], policy_version=0))

    try:
        trio.run(attack)
        assert out["hello_takeover"].code == "actor_id_in_use"
        assert out["goodbye"].code == "not_registered" and out["heartbeat_as_real"].code == "not_registered"
        assert (out["forged_group"].accepted, out["forged_group"].reason) == (False, "not_holder")
        assert out["forged_as_real"].code == "not_registered"
        assert len(out["hoard"].leases) == 4  # its fair share, ceil(window 8 / 2 actors), not the free 6
        second = out["second_id"]
        assert second.code == "too_many_actor_ids" and "learner.max_actor_ids_per_connection" in second.message
        assert isinstance(out["real_heartbeat"], HeartbeatAck) and out["real_heartbeat"].unknown_lease_ids == []
        assert out["real_group"].accepted, out["real_group"]  # never a "duplicate" of the forgery
        assert len(out["real_again"].leases) == 1 and out["hoard_again"].leases == []
        assert out["huge_id_reply"].code == "bad_message"
        assert type(out["over_frame"]).__name__ == "PeerTimeout"
        rss0, rss1, log_growth = out["huge_ids"]
        print(f"100 Hellos with 512 KB ids: learner RSS {rss0:.0f} -> {rss1:.0f} MB, log +{log_growth} bytes")
        assert log_growth < 100_000 and rss1 - rss0 < 60
        assert out["oversize"].code == "bad_message" and "over the learner's limit" in out["oversize"].message
        assert isinstance(out["after"], HeartbeatAck) and out["after"].unknown_lease_ids == []
        assert learner.alive()
    finally:
        ctx.destroy(linger=0)
        procs.close(grace_s=8)


HOARD_ATTACK_S = 4.0
"""How long the hoarder attacks while the honest client plays (a few rounds of leases)."""


@pytest.mark.timeout(240)
def test_an_honest_actor_gets_leases_during_a_hoarding_attack_with_the_default_settings(tmp_path, tiny_model_dir):
    """A real learner with every lease setting at its default (window (1 + 1) * 4 = 8 groups,
    ``learner.max_leases_per_actor`` 64).  A hoarder takes the whole window while alone, then
    keeps asking for 10^6 leases and heartbeating its leases without ever returning a group
    or reporting generation progress.  Meanwhile an honest client asks for 2 leases at a time
    and returns each group at once.  During the attack the honest client gets leases on its
    first request and keeps getting them (a training step's worth), and whenever it waits
    for leases the hoarder holds at most its fair share, ceil(8 / 2) = 4.  (Before fair
    shares the honest client got 0 leases: the hoarder held the window for good.)"""
    from turnscale.protocol.messages import ControlRequest, Heartbeat

    ports = [free_port() for _ in range(3)]
    procs = ProcessGroup(tmp_path / "logs", "turnscale")
    learner = procs.start("learner", [
        "learner", f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
        f"model.path={tiny_model_dir}", f"learner.dir={tmp_path / 'learner'}", "learner.steps=1000",
        "logger.tensorboard=false", "logger.console_every_s=0"])
    ctx = zmq.Context()
    out: dict = {"rounds": [], "hoarder_told": 0}

    def conn():
        s = AsyncSocket(configure(ctx.socket(zmq.DEALER)))
        s.sock.connect(f"tcp://127.0.0.1:{ports[0]}")
        return Requester(s)

    def hello(actor_id, max_groups):
        return Hello(actor_id=actor_id, host="h", pid=1, engine="fake", device="cpu", max_groups=max_groups)

    async def hoard(req, held: set):
        """Ask for 10^6 and heartbeat (no progress) every 0.2 s; drop what the learner revoked."""
        while True:
            g = await req.request(LeaseRequest(actor_id="hoarder", max_leases=1_000_000), timeout_s=10)
            held |= {l.lease_id for l in g.leases}
            ack = await req.request(Heartbeat(actor_id="hoarder", lease_ids=sorted(held), policy_version=0,
                                              stats={"tokens_generated": 0.0}), timeout_s=10)
            out["hoarder_told"] += len(ack.unknown_lease_ids)
            held -= set(ack.unknown_lease_ids)
            await trio.sleep(0.2)

    async def play(req, ctl, t0):
        """An honest client: ask for what it lacks, return each group at once, read the status."""
        while True:
            g = await req.request(LeaseRequest(actor_id="honest", max_leases=2), timeout_s=10)
            st = await ctl.request(ControlRequest(), timeout_s=10)
            leases = {a.actor_id: a.leases for a in st.actors}
            out["rounds"].append((trio.current_time() - t0, len(g.leases), leases.get("hoarder", 0)))
            for lease in g.leases:
                ack = await req.request(make_group(lease, actor_id="honest"), timeout_s=10)
                out["accepted"] = out.get("accepted", 0) + int(ack.accepted)
            if len(g.leases) < 2:
                await trio.sleep(g.retry_after_s)

    async def attack():
        hoarder, honest, ctl = conn(), conn(), conn()
        with trio.fail_after(150):
            while True:  # the learner takes a few seconds to load the model
                try:
                    if isinstance(await hoarder.request(hello("hoarder", 1000), timeout_s=2), Welcome):
                        break
                except Exception:
                    assert learner.alive(), learner.tail()
                    await trio.sleep(0.5)
            assert isinstance(await honest.request(hello("honest", 2), timeout_s=10), Welcome)
        alone = await hoarder.request(LeaseRequest(actor_id="hoarder", max_leases=1_000_000), timeout_s=10)
        out["alone"] = len(alone.leases)
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(hoard, hoarder, {l.lease_id for l in alone.leases})
            n.start_soon(play, honest, ctl, t0)
            await trio.sleep(HOARD_ATTACK_S)
            n.cancel_scope.cancel()

    try:
        trio.run(attack)
        rounds = out["rounds"]
        print(f"hoarder alone: {out['alone']} leases; honest rounds (t, got, hoarder holds): {rounds}; "
              f"accepted {out.get('accepted', 0)}, hoarder told of {out['hoarder_told']} revoked")
        assert out["alone"] == 8  # a lone actor may use the whole window
        t_first, got_first, _ = rounds[0]
        assert got_first == 2, rounds  # its first request, while the hoarder holds the window
        assert t_first < 2.0, rounds  # one round trip; 2 s leaves room for a loaded 2-core CI box
        assert out.get("accepted", 0) >= 4, rounds  # a training step's worth of groups during the attack
        waiting = [(t, hoarder) for t, got, hoarder in rounds if got < 2]
        assert all(hoarder <= 4 for _, hoarder in waiting), waiting  # at most its share while the honest waits
        assert rounds[-1][2] <= 4 and out["hoarder_told"] >= 4  # cut to its share, and told so
        assert learner.alive(), learner.tail()
    finally:
        ctx.destroy(linger=0)
        procs.close(grace_s=8)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_group_that_breaks_the_step_costs_only_itself_and_the_other_actors_group_trains(tmp_path, tiny_model_dir):
    """With the intake bound off (``learner.max_abs_reward=0``), one actor's group with a
    reward of 1e300 reaches the trainer beside an honest actor's group in the same step: its
    statistics overflow, the trainer drops it (ledger ``dropped_nonfinite``, its task
    re-issued) and the step trains the honest group.  Before, the whole step was skipped
    as non-finite and the honest group thrown away with it, again and again."""
    from tests.unit.fakes import make_group
    from turnscale.protocol.messages import Goodbye

    ports = [free_port() for _ in range(3)]
    run_dir = tmp_path / "learner"
    procs = ProcessGroup(tmp_path / "logs", "turnscale")
    learner = procs.start("learner", [
        "learner", f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
        f"model.path={tiny_model_dir}", f"learner.dir={run_dir}", "learner.steps=1", "learner.groups_per_step=2",
        "algo.group_size=2", "learner.max_staleness=0", "learner.max_abs_reward=0",
        "logger.tensorboard=false", "logger.console_every_s=0", "learner.heartbeat_interval_s=1"])
    ctx = zmq.Context()

    async def connect(actor_id):
        sock = AsyncSocket(configure(ctx.socket(zmq.DEALER)))
        sock.sock.connect(f"tcp://127.0.0.1:{ports[0]}")
        req = Requester(sock)
        while True:  # the learner takes a few seconds to load the model
            try:
                w = await req.request(Hello(actor_id=actor_id, host="h", pid=1, engine="fake", device="cpu", max_groups=1),
                                      timeout_s=2)
            except Exception:
                assert learner.alive(), learner.tail()
                await trio.sleep(0.5)
                continue
            assert isinstance(w, Welcome), w
            return req

    async def lease(req, actor_id):
        while True:
            g = await req.request(LeaseRequest(actor_id=actor_id, max_leases=1), timeout_s=10)
            assert isinstance(g, LeaseGrant), g
            if g.leases:
                return g.leases[0]
            await trio.sleep(0.05)

    async def act():
        with trio.fail_after(150):
            honest, poisoner = await connect("honest"), await connect("poisoner")
            good, bad = await lease(honest, "honest"), await lease(poisoner, "poisoner")
            poisoned = make_group(bad, actor_id="poisoner")
            poisoned = replace(poisoned, episodes=[replace(poisoned.episodes[0], reward=1e300), *poisoned.episodes[1:]])
            acks = [await poisoner.request(poisoned, timeout_s=10), await honest.request(make_group(good, actor_id="honest"), timeout_s=10)]
            assert all(isinstance(a, GroupAck) and a.accepted for a in acks), acks  # the bound is off: both accepted
            ledger = run_dir / "batches.jsonl"
            while not ledger.exists() or len(ledger.read_text().splitlines()) < 2:
                assert learner.alive(), learner.tail()
                await trio.sleep(0.2)
            for req, aid in ((honest, "honest"), (poisoner, "poisoner")):
                await req.request(Goodbye(actor_id=aid, reason="done"), timeout_s=10)
            return good, bad, [json.loads(x) for x in ledger.read_text().splitlines()]

    try:
        good, bad, ledger = trio.run(act)
        outcomes = {(r["lease_id"], r["outcome"], r["step"]) for r in ledger}
        assert outcomes == {(bad.lease_id, "dropped_nonfinite", 1), (good.lease_id, "trained", 1)}, ledger
        deadline = time.monotonic() + 60
        while learner.alive() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert learner.popen.returncode == 0, learner.tail(40)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1] and rows[0]["train/groups_dropped/nonfinite"] == 1
        assert "train/steps_skipped/nonfinite" not in rows[0]
        log = learner.log_path.read_text(errors="replace")
        assert f"group {bad.lease_id} from actor poisoner dropped from step 1 (non-finite rewards" in log
        assert "Traceback" not in log
    finally:
        ctx.destroy(linger=0)
        procs.close(grace_s=8)
