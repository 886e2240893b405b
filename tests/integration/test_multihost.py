"""The real roles on fake hosts (``cluster.netns``): a learner on host L (bound to its own
address), a BabyAI envhub on host E (the learner announces E's address), actors on hosts A1..A3
with the tiny model.  Mid-run one actor host's link is cut while another actor leaves on
SIGTERM; an actor joins late (it booted behind a cut link); the cut link is restored: the run completes
every step, the cut actor re-registers and trains again, the late one trains, every process
exits 0, and teardown leaves no namespace, link or process behind.  CURVE is on (``enabled=auto``
is on for the namespaces' non-loopback addresses), as a user off loopback gets it.
Needs root; skips with the reason elsewhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from turnscale.cluster.netns import Cluster, available, leftovers
from tests.integration.curvekeys import curve_overrides, make_keys
from tests.integration.test_learner_e2e import TINY, read_jsonl, wait_exit

_ok, _why = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _ok, reason=f"test cluster unavailable: {_why}")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_PORT = 8301  # every fake host has its own ports: fixed numbers are free


def curve_for(tmp_path, role: str, actor: int = 0) -> list[str]:
    """CURVE for ``role`` with keys under ``tmp_path`` (made once): ``enabled=auto``, which is on
    here because the fake hosts' addresses are not loopback (the default a user gets)."""
    keys = tmp_path / "keys"
    if not keys.exists():
        make_keys(str(keys), actors=3)
    return curve_overrides(str(keys), role, actor=actor or 1, enabled="auto")


def spawn_role(c: Cluster, host: str, args: list[str], log_path: str) -> subprocess.Popen:
    """``python -m turnscale <args>`` inside ``host``, output to ``log_path`` (as
    ``test_learner_e2e.start``, in a fake host; this worktree's code: cwd is the repo root)."""
    log = open(log_path, "w")
    try:
        return c.spawn(host, [sys.executable, "-m", "turnscale", *args], stdout=log, stderr=subprocess.STDOUT,
                       cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        log.close()  # the child holds its own descriptor


def wait_healthy_in(c: Cluster, host: str, url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url/health`` from inside ``host`` (the root namespace has no address on the bridge)."""
    probe = ("import sys, time, urllib.request\n"
             f"end = time.monotonic() + {timeout_s}\n"
             "while time.monotonic() < end:\n"
             "    try:\n"
             "        if urllib.request.urlopen(sys.argv[1] + '/health', timeout=1).status == 200: sys.exit(0)\n"
             "    except OSError: pass\n"
             "    time.sleep(0.2)\n"
             "sys.exit(1)\n")
    r = c.run(host, [sys.executable, "-c", probe, url], timeout=timeout_s + 10)
    assert r.returncode == 0 and proc.poll() is None, f"envhub at {url} not healthy within {timeout_s} s"


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _playing(log_path: str) -> bool:
    """The actor holds weights (it plays leases from now on)."""
    return "applied weights version" in _text(log_path)


def _step(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    rows = read_jsonl(path)
    return rows[-1]["step"] if rows else 0


def _until(cond, timeout_s: float, what: str, procs: list[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        dead = [p.pid for p in procs if p.poll() is not None]
        assert not dead, f"process(es) {dead} exited while waiting for {what}"
        time.sleep(0.2)


def test_roles_on_fake_hosts_survive_join_leave_and_a_cut_link(tmp_path):
    run_dir = str(tmp_path / "run")
    steps = 12
    hosts = ["L", "E", "A1", "A2", "A3"]
    logs = {name: str(tmp_path / f"{name}.log") for name in ("envhub", "learner", "a1", "a2", "a3")}
    events: dict[str, int] = {}  # event -> learner step when it happened
    t0 = time.monotonic()
    c = Cluster(hosts, rate_mbit=200)
    try:
        with c:
            env_url = f"http://{c.addr('E')}:{ENV_PORT}"
            common = [f"learner.host={c.addr('L')}", f"actor.learner_host={c.addr('L')}",
                      f"env.host={c.addr('E')}", f"env.port={ENV_PORT}", f"model.cache_dir={tmp_path / 'cache'}",
                      *TINY, "schedule.turns=[2]", "sampling.max_new_tokens=12", "algo.group_size=2",
                      "algo.lr=1e-3", "learner.groups_per_step=2", "learner.max_staleness=2", f"learner.dir={run_dir}",
                      "learner.checkpoint_every=1000", "learner.heartbeat_interval_s=1", "learner.lease_ttl_s=15",
                      "logger.tensorboard=false", "logger.console_every_s=0", "actor.max_groups=1",
                      "actor.request_timeout_s=3", "actor.reconnect_max_backoff_s=1", "actor.shutdown_grace_s=5"]
            envhub = spawn_role(c, "E", ["envhub", "env=babyai", f"host={c.addr('E')}", f"port={ENV_PORT}"],
                                logs["envhub"])
            learner = spawn_role(c, "L", ["learner", *common, *curve_for(tmp_path, "learner"), f"learner.steps={steps}",
                                          "learner.debug_step_delay_s=1.0"], logs["learner"])
            a1 = spawn_role(c, "A1", ["actor", *common, *curve_for(tmp_path, "actor", 1), "actor.actor_id=a1"], logs["a1"])
            a2 = spawn_role(c, "A2", ["actor", *common, *curve_for(tmp_path, "actor", 2), "actor.actor_id=a2"], logs["a2"])
            # a3 starts with its host cut off, so it boots now but can only join once its link is up
            c.set_link("A3", False)
            a3 = spawn_role(c, "A3", ["actor", *common, *curve_for(tmp_path, "actor", 3), "actor.actor_id=a3"], logs["a3"])
            wait_healthy_in(c, "A1", env_url, envhub, 60)  # E's address, as the actors reach it

            # once a1 and a2 train: A1's link is cut and a2 leaves on SIGTERM.  No actor can feed
            # the learner now (a3 is still cut off), so the run waits for what follows
            _until(lambda: _step(run_dir) >= 1 and all(_playing(logs[a]) for a in ("a1", "a2")),
                   150, "the first step with a1 and a2 playing", [learner, a1, a2, a3])
            c.set_link("A1", False)
            events["A1 cut"] = _step(run_dir)
            os.kill(a2.pid, signal.SIGTERM)  # graceful: finishes or abandons its group, says goodbye
            assert wait_exit([a2], 30) == [0], "a2 did not exit 0 on SIGTERM"
            events["a2 left"] = _step(run_dir)

            # a1 notices the cut.  a3 joins late (its link comes up) and plays while a1 is still
            # cut off; then A1's link is restored and a1 registers again (and trains again, below)
            _until(lambda: "learner lost" in _text(logs["a1"]), 30, "a1 to notice the cut", [learner, a1, a3])
            events["a1 lost"] = _step(run_dir)
            assert "actor a3 registered" not in _text(logs["learner"])
            c.set_link("A3", True)
            events["a3 joins"] = _step(run_dir)
            _until(lambda: "actor a3 registered" in _text(logs["learner"]) and _playing(logs["a3"]),
                   60, "a3 to register and load weights", [learner, a1, a3])
            events["a3 plays"] = _step(run_dir)
            c.set_link("A1", True)
            events["A1 restored"] = _step(run_dir)
            _until(lambda: _text(logs["a1"]).count("registered with learner run") >= 2, 30, "a1 to re-register",
                   [learner, a1, a3])
            events["a1 re-registered"] = _step(run_dir)
            assert events["a1 re-registered"] < steps - 2, f"the run nearly ended before a1 came back: {events}"

            codes = wait_exit([learner, a1, a3], 180)
            events["end"] = _step(run_dir)
            assert codes == [0, 0, 0], f"learner, a1, a3 exit codes: {codes}"

            metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            assert [m["step"] for m in metrics] == list(range(1, steps + 1))
            ledger = read_jsonl(os.path.join(run_dir, "batches.jsonl"))
            trained = [b for b in ledger if b["outcome"] == "trained"]
            assert len(trained) == 2 * steps and len({b["lease_id"] for b in trained}) == 2 * steps
            by_actor = {a: [b["step"] for b in trained if b["actor_id"] == a] for a in ("a1", "a2", "a3")}
            assert by_actor["a3"], "the late joiner trained nothing"
            assert any(s > events["A1 restored"] for s in by_actor["a1"]), \
                f"a1 trained nothing after its link came back: {by_actor['a1']}, {events}"
            learner_log = _text(logs["learner"])
            for a in ("a1", "a2", "a3"):
                assert f"actor {a} registered" in learner_log
            # CURVE is on by default off loopback: every connection above was authenticated
            assert "CURVE on:" in learner_log and "INSECURE" not in learner_log
            # actors on other hosts relay weights to each other (over CURVE too, their relays' keys
            # handed out by the learner): some chunks came from a relay, not the learner
            from_relays = [int(x) for a in ("a1", "a2", "a3")
                           for x in re.findall(r"weight_chunks_from_relays=(\d+)", _text(logs[a]))]
            assert sum(from_relays) > 0, f"no weight chunk came through a relay: {from_relays}"
            prefix = c.prefix
        assert not leftovers(prefix), leftovers(prefix)
        assert all(p.poll() is not None for p in c.procs)
        print(f"events (learner step): {events}; {time.monotonic() - t0:.1f} s; per actor: "
              f"{ {a: len(s) for a, s in by_actor.items()} }")
    except BaseException:
        print(f"events (learner step): {events}")
        for name in ("a2", "a1", "a3", "envhub", "learner"):  # the learner's long log last
            if os.path.exists(logs[name]):
                lines = [ln for ln in _text(logs[name]).splitlines() if not re.search(r"lease \S+ \(task", ln)]
                print(f"===== {name}\n" + "\n".join(lines)[-4000:])
        raise
    finally:
        c.close()
    assert not leftovers(c.prefix)
