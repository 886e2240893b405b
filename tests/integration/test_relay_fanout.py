"""Weight fan-out through actor relays with a real learner and real actor processes on
127.0.0.1 (sim engine, tiny model): actors in a chain (``learner.relay.fanout=1``) all
reach every version through the checked pull; one actor's relay serves corrupted bytes
(``TURNSCALE_TEST_RELAY_CORRUPT=1``: its child refuses them by checksum and fetches them
elsewhere) and one relay is SIGKILLed while versions are being fanned out (its child
retries from another source); no torn or wrong version is ever applied, and the
learner's egress per version stays within ``fanout`` copies while the tree is whole."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from turnscale.protocol.transport import free_port
from tests.envhub_proc import envhub_server
from tests.integration.test_learner_e2e import TINY, end, final_actor_stats, read_jsonl, start, wait_exit


def applied_versions(path: str) -> list[int]:
    return [int(v) for v in re.findall(r"applied weights version (\d+)", open(path).read())]


@pytest.mark.slow
def test_chain_of_relays_survives_a_corrupt_and_a_killed_relay(tmp_path):
    run_dir = str(tmp_path / "run")
    ports = [free_port() for _ in range(3)]
    common = [f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
              f"actor.learner_port={ports[0]}", f"model.cache_dir={tmp_path / 'cache'}", *TINY,
              "schedule.turns=[2]", "sampling.max_new_tokens=8", "algo.group_size=2", "algo.lr=1e-3",
              "learner.groups_per_step=2", "learner.max_staleness=1", f"learner.dir={run_dir}",
              "learner.checkpoint_every=100000", "learner.heartbeat_interval_s=1", "learner.lease_ttl_s=6",
              "logger.tensorboard=false", "logger.console_every_s=0", "learner.chunk_mb=0.02",
              "learner.relay.fanout=1", "learner.relay.fallback_hops=2", "learner.save_trajectories=false",
              "engine=sim", "engine.sim.decode_s_per_step=0.002", "engine.sim.mean_new_tokens=6",
              "actor.max_groups=1", "actor.request_timeout_s=10", "actor.shutdown_grace_s=2",
              "actor.relay_host=127.0.0.1"]
    logs = {n: str(tmp_path / f"{n}.log") for n in ["learner", "a1", "a2", "a3", "a4"]}
    procs = []

    def registered(n):
        return f"actor {n} registered" in open(logs["learner"]).read()

    def wait(cond, what, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        with envhub_server("babyai") as env_url:
            common.append(f"env.port={env_url.rsplit(':', 1)[1]}")
            learner = start(["learner", *common, "learner.steps=100000", "learner.debug_step_delay_s=0.3"], logs["learner"])
            procs.append(learner)
            actors = {}
            # registration order is the chain's order: learner -> a1 -> a2 (serves corrupt bytes) -> a3
            for n in ("a1", "a2", "a3"):
                env = {"TURNSCALE_TEST_RELAY_CORRUPT": "1"} if n == "a2" else {}
                actors[n] = start(["actor", *common, f"actor.actor_id={n}"], logs[n], env=env)
                procs.append(actors[n])
                wait(lambda: registered(n) or actors[n].poll() is not None, f"{n} did not register", 90)
            wait(lambda: len(applied_versions(logs["a3"])) >= 3, "a3 applied no three versions", 60)
            # the chain's head is SIGKILLed while versions flow through it: a2 (sources [a1]) and
            # a3 (sources [a2 corrupt, a1 dead]) fall back, ultimately to the learner
            os.kill(actors["a1"].pid, signal.SIGKILL)
            killed_at = {n: len(applied_versions(logs[n])) for n in ("a2", "a3")}
            wait(lambda: all(len(applied_versions(logs[n])) >= killed_at[n] + 3 for n in ("a2", "a3")),
                 "a2/a3 stopped applying versions after a1 died", 60)
            for n in ("learner", "a2", "a3"):
                p = learner if n == "learner" else actors[n]
                os.kill(p.pid, signal.SIGTERM)
            codes = wait_exit([learner, actors["a2"], actors["a3"]], 60)
            assert codes == [0, 0, 0], codes

            stats = {}
            for n in ("a2", "a3"):
                seen = applied_versions(logs[n])
                assert seen == sorted(seen) and len(set(seen)) == len(seen), (n, seen)  # each version once, in order
                stats[n] = final_actor_stats(logs[n])
                assert stats[n]["torn_weights"] == 0, (n, stats[n])
            head = applied_versions(logs["a1"])
            assert head == sorted(head) and len(head) >= 3
            assert stats["a2"]["weight_chunks_from_relays"] > 0  # through a1 while it lived
            assert stats["a3"]["weight_relay_fallbacks"] > 0  # a2's corrupt bytes refused by checksum, a1's death
            metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            assert any("weights/learner_egress_copies" in m for m in metrics), "no learner egress metric"
            per_version = [float(c) for c in re.findall(r"learner egress \d+ bytes \(([\d.]+) copies\)",
                                                        open(logs["learner"]).read())]
            # fanout=1: a1's copy, plus what a3 re-fetches from the learner because a2 is corrupt
            # (and, after a1's death, a2's own copy): never one per actor and more
            assert per_version and max(per_version) <= 3.0 + 1e-9, per_version
            assert min(per_version) <= 1.0 + 1e-9, per_version  # one copy while only a1 (the head) pulled
    except BaseException:
        for n, p in logs.items():
            if os.path.exists(p):
                print(f"----- {n}\n" + open(p).read()[-4000:])
        raise
    finally:
        for p in procs:
            end(p)
