"""A real actor process (hf engine, tiny model) against a stand-in learner in this test and a
real BabyAI envhub server, all on 127.0.0.1: registers, pulls weights, completes leases,
swaps to a new version mid-run, survives the learner stopping and coming back, and exits
cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests.envhub_proc import envhub_server
from tests.integration.standin_learner import StandInLearner


def sampled_versions(group) -> set[int]:
    out: set[int] = set()
    for ep in group.episodes:
        mask = np.asarray(ep.loss_mask, bool)
        out |= set(np.asarray(ep.versions)[mask].tolist())
    return out


@pytest.mark.slow
def test_actor_registers_pulls_swaps_survives_restart_and_stops_on_sigterm(tiny_model_dir):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    with envhub_server("babyai") as env_url:
        learner = StandInLearner(model_path=tiny_model_dir, env_url=env_url, state_dict=sd)
        learner.start()
        log = tempfile.NamedTemporaryFile("w+", prefix="actor-", suffix=".log", delete=False)
        args = [sys.executable, "-m", "turnscale", "actor", f"actor.learner_port={learner.port}", "actor.max_groups=2",
                "actor.request_timeout_s=3", "actor.reconnect_max_backoff_s=1", "actor.shutdown_grace_s=5",
                "actor.actor_id=test-actor", "engine=hf", "engine.max_batch=8"]
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            learner.wait_for(lambda: len(learner.hellos) >= 1, 60, "Hello")
            learner.wait_for(lambda: len(learner.groups) >= 2, 90, "two groups at version 0")
            assert learner.publisher.served_chunks >= len(learner.manifest.chunks)  # the initial pull
            for g, lease in learner.groups:
                assert not g.failed, g.error
                assert len(g.episodes) == lease.group_size and g.turn_limit == lease.turn_limit
                assert all(ep.turn_limit == 2 and len(ep.turns) <= 2 for ep in g.episodes)
                assert sampled_versions(g) == {0}
                assert all(ep.category.startswith("BabyAI-") for ep in g.episodes)

            # a new version mid-run: leases issued under it are played with it
            learner.publish(1)
            learner.wait_for(lambda: any(l.policy_version == 1 for _, l in learner.groups), 60, "a group leased at version 1")
            v1 = [g for g, l in learner.groups if l.policy_version == 1]
            assert all(sampled_versions(g) == {1} for g in v1)
            learner.wait_for(lambda: any(h.policy_version == 1 for h in learner.heartbeats), 30, "a heartbeat reporting version 1")

            # the learner goes away and comes back resuming the same run (same run id, same
            # version number, new incarnation): the actor re-registers and pulls again
            learner.stop()
            n_before = len(learner.groups)
            learner.wait_for(lambda: "learner lost" in open(log.name).read(), 60, "the actor noticing the lost learner")
            assert len(learner.groups) == n_before
            assert proc.poll() is None, "actor must survive a lost learner"
            served = learner.publisher.served_chunks
            learner.start()
            learner.wait_for(lambda: len(learner.hellos) >= 2, 60, "a second Hello after the restart")
            assert {h.actor_id for h in learner.hellos} == {"test-actor"}
            learner.wait_for(lambda: len(learner.groups) >= n_before + 1, 60, "groups after the restart")
            assert learner.publisher.served_chunks >= served + len(learner.manifest.chunks)  # v1 pulled again

            # SIGTERM: finish or abandon, say goodbye, exit 0 within the grace period + slack
            os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=30)
            assert rc == 0
            assert [g.actor_id for g in learner.goodbyes] == ["test-actor"]
            assert learner.goodbyes[0].reason == "sigterm"
            assert not learner.errors
        except BaseException:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR1)  # stack dump into the log
                time.sleep(1.0)
            log.seek(0)
            print(log.read()[-6000:])
            raise
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            learner.close()
            log.close()
            os.unlink(log.name)


def test_an_actor_with_batched_env_steps_plays_groups_through_step_batch(tiny_model_dir):
    """``actor.env_batch_steps=true``: the actor's concurrent episodes reach the real envhub
    through ``POST /v1/step_batch`` and its groups come back whole."""
    import json
    import urllib.request

    from safetensors.torch import load_file

    sd = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    with envhub_server("babyai") as env_url:
        learner = StandInLearner(model_path=tiny_model_dir, env_url=env_url, state_dict=sd, group_size=4, turn_limit=4, max_new_tokens=64)
        learner.start()
        log = tempfile.NamedTemporaryFile("w+", prefix="actor-", suffix=".log", delete=False)
        args = [sys.executable, "-m", "turnscale", "actor", f"actor.learner_port={learner.port}", "actor.max_groups=2",
                "actor.request_timeout_s=3", "actor.shutdown_grace_s=5", "actor.actor_id=batch-actor", "actor.env_batch_steps=true",
                "engine=sim", "engine.max_batch=8"]  # the sim engine writes agent-style text: its actions parse and reach the env
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            learner.wait_for(lambda: len(learner.groups) >= 4, 120, "four groups")
            for g, lease in learner.groups:
                assert not g.failed, g.error
                assert len(g.episodes) == lease.group_size
            with urllib.request.urlopen(env_url + "/v1/metrics", timeout=10) as r:
                m = json.loads(r.read())
            assert m["steps"] > 0 and m["latency"]["step_batch"]["count"] > 0 and "http /v1/step" not in m["latency"]
            assert m["errors"] == {}
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert not learner.errors
        except BaseException:
            log.seek(0)
            print(log.read()[-6000:])
            raise
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            learner.close()
            log.close()
            os.unlink(log.name)
