"""A real learner, two real actors and a real BabyAI envhub, as processes on 127.0.0.1 with
the tiny model: groups are trained, versions advance, nothing is trained twice, everyone
exits cleanly on the learner's Shutdown; a restarted learner resumes where it stopped, a
SIGTERM'd learner checkpoints first, and an actor survives its learner restarting."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from turnscale import conf
from turnscale.protocol.transport import free_port
from tests.envhub_proc import envhub_server

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
        "model.tiny.intermediate_size=128", "model.tiny.vocab_size=1024"]


def start(args: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "turnscale", *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_exit(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    return [p.poll() for p in procs]


def final_actor_stats(log_path: str) -> dict[str, int]:
    """The integer counters of the ``ActorStats(...)`` an actor logs when it stops."""
    stopped = [line for line in open(log_path) if " stopped (" in line and "ActorStats(" in line]
    assert stopped, f"{log_path}: no final ActorStats line"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)\b(?!\.)", stopped[-1].split("ActorStats(", 1)[1])}


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_learner_and_two_actors_train_publish_and_resume(tmp_path):
    run_dir = str(tmp_path / "run")
    ports = [free_port() for _ in range(3)]
    common = [f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
              f"actor.learner_port={ports[0]}", f"model.cache_dir={tmp_path / 'cache'}", *TINY,
              "schedule.turns=[2]", "sampling.max_new_tokens=12", "algo.group_size=2", "algo.lr=1e-3",
              "learner.groups_per_step=2", "learner.max_staleness=1", f"learner.dir={run_dir}",
              "learner.checkpoint_every=2", "learner.heartbeat_interval_s=1", "logger.tensorboard=false",
              "logger.console_every_s=0", "actor.max_groups=2", "actor.request_timeout_s=10", "actor.shutdown_grace_s=5"]
    logs = {name: str(tmp_path / f"{name}.log") for name in ("learner", "a1", "a2", "learner2", "learner3", "a3")}
    procs: list[subprocess.Popen] = []
    try:
        with envhub_server("babyai") as env_url:
            env_port = env_url.rsplit(":", 1)[1]
            common.append(f"env.port={env_port}")
            learner = start(["learner", *common, "learner.steps=4"], logs["learner"])
            procs.append(learner)
            actors = [start(["actor", *common, f"actor.actor_id=a{i}"], logs[f"a{i}"]) for i in (1, 2)]
            procs += actors
            codes = wait_exit([learner, *actors], 240)
            assert codes == [0, 0, 0], codes

            metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            assert [m["step"] for m in metrics] == [1, 2, 3, 4]
            versions = [m["perf/version"] for m in metrics]
            assert versions == sorted(versions) and versions[-1] == 3  # published after every step
            assert metrics[-1]["rollout/trained_groups_total"] == 8
            # actors on the learner's host read the weights from its shared-memory segments, untorn.
            # Read from each actor's final stats line: the learner's metrics only carry what a
            # heartbeat (1 s here) delivered, and four steps can end within one heartbeat.
            final = [final_actor_stats(logs[a]) for a in ("a1", "a2")]
            assert sum(st["weight_chunks_from_shm"] for st in final) > 0, f"no same-host weight read: {final}"
            assert all(st["torn_weights"] == 0 for st in final), final
            assert all(m.get("actors/torn_weights", 0) == 0 for m in metrics)
            assert all(m["rollout/turn_limit"] == 2 for m in metrics)
            trajs = read_jsonl(os.path.join(run_dir, "trajectories.jsonl"))
            accepted = {(t["lease_id"], t["episode"]) for t in trajs if t["accepted"]}
            assert len(accepted) == sum(t["accepted"] for t in trajs)  # no episode accepted twice
            assert len({t["lease_id"] for t in trajs if t["accepted"]}) >= 8
            assert all(t["turn_limit"] == 2 and t["num_turns"] <= 2 for t in trajs)
            assert all(t["prompt"].startswith("<|im_start|>system") for t in trajs)
            learner_log = open(logs["learner"]).read()
            assert "actor a1 registered" in learner_log and "actor a2 registered" in learner_log
            assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step-00000004"))
            assert conf.load_file(os.path.join(run_dir, "config.yaml")).learner.dir == run_dir  # the resolved config

            # a restarted learner resumes at step 4 / version 4; SIGTERM checkpoints it mid-run;
            # a third learner resumes from there, and the same actor feeds both
            learner2 = start(["learner", *common, "learner.steps=100", "learner.resume=true"], logs["learner2"])
            procs.append(learner2)
            a3 = start(["actor", *common, "actor.actor_id=a3"], logs["a3"])
            procs.append(a3)
            deadline = time.monotonic() + 180
            while read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[-1]["step"] < 6:
                assert time.monotonic() < deadline and learner2.poll() is None, "learner2 did not reach step 6"
                time.sleep(0.5)
            os.kill(learner2.pid, signal.SIGTERM)
            assert wait_exit([learner2], 60) == [0]
            steps = [m["step"] for m in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
            n = steps[-1]
            assert steps == list(range(1, n + 1))
            assert os.path.isdir(os.path.join(run_dir, "checkpoints", f"step-{n:08d}"))  # written on SIGTERM
            assert "resumed at step 4, version 4" in open(logs["learner2"]).read()
            time.sleep(1.0)
            assert a3.poll() is None, "the actor survives its learner going away"

            learner3 = start(["learner", *common, f"learner.steps={n + 2}", "learner.resume=true"], logs["learner3"])
            procs.append(learner3)
            codes = wait_exit([learner3, a3], 240)
            assert codes == [0, 0], codes
            metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            assert [m["step"] for m in metrics] == list(range(1, n + 3))
            assert [m["perf/version"] for m in metrics[n:]] == [n, n + 1]
            assert metrics[-1]["rollout/trained_groups_total"] == 2 * (n + 2)
            assert f"resumed at step {n}, version {n}" in open(logs["learner3"]).read()
            assert open(logs["a3"]).read().count("registered with learner run") == 2
    except BaseException:
        for name, path in logs.items():
            if os.path.exists(path):
                print(f"===== {name}\n" + open(path).read()[-4000:])
        raise
    finally:
        for p in procs:
            end(p)
