"""CURVE refusal with real processes on 127.0.0.1 (``learner.curve.enabled=true``): a real
learner, two actors with authorized keys that train, an actor with an unauthorized key
and one holding another learner's public key, each refused with a clear error and exit
code 3 while the run completes; a plain ZeroMQ client gets no reply from the CURVE learner."""

from __future__ import annotations

import os

import pytest
import zmq

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.curve import create_keys, create_pair, load_secret
from turnscale.protocol.transport import configure, free_port, tcp_endpoint
from tests.envhub_proc import envhub_server
from tests.integration.curvekeys import curve_overrides
from tests.integration.test_learner_e2e import TINY, end, read_jsonl, start, wait_exit

EXIT_CURVE_REFUSED = 3


def plain_client_gets_no_reply(port: int, wait_ms: int = 2000) -> bool:
    """A DEALER without CURVE sends a Hello to the learner's control port: True when no reply comes."""
    ctx = zmq.Context()
    try:
        d = configure(ctx.socket(zmq.DEALER))
        d.connect(tcp_endpoint("127.0.0.1", port))
        hello = m.Hello(actor_id="plain", host="h", pid=1, engine="fake", device="cpu", max_groups=1)
        d.send_multipart([b"\0" * 8, *codec.encode(hello)], flags=zmq.NOBLOCK)  # queued until connected
        return d.poll(wait_ms) == 0
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_curve_learner_trains_authorized_actors_and_refuses_wrong_keys(tmp_path):
    keys = str(tmp_path / "keys")
    ks = create_keys(keys, actors=2)
    stranger = create_pair(str(tmp_path), "stranger")[1]  # a key pair the learner never authorized
    other = create_keys(str(tmp_path / "other"), actors=0)  # another learner's keys
    run_dir = str(tmp_path / "run")
    ports = [free_port() for _ in range(3)]
    common = [f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
              f"actor.learner_port={ports[0]}", f"model.cache_dir={tmp_path / 'cache'}", *TINY,
              "schedule.turns=[2]", "sampling.max_new_tokens=8", "algo.group_size=2", "learner.groups_per_step=2",
              "learner.max_staleness=1", f"learner.dir={run_dir}", "learner.checkpoint_every=100",
              "learner.heartbeat_interval_s=1", "logger.tensorboard=false", "logger.console_every_s=0",
              "actor.max_groups=2", "actor.request_timeout_s=10", "actor.shutdown_grace_s=5"]
    names = ("learner", "a1", "a2", "stranger", "wrong_server")
    logs = {n: str(tmp_path / f"{n}.log") for n in names}
    procs = []
    try:
        with envhub_server("babyai") as env_url:
            common.append(f"env.port={env_url.rsplit(':', 1)[1]}")
            learner = start(["learner", *common, "learner.steps=2", *curve_overrides(keys, "learner")], logs["learner"])
            procs.append(learner)
            good = [start(["actor", *common, f"actor.actor_id=a{i}", *curve_overrides(keys, "actor", actor=i)], logs[f"a{i}"])
                    for i in (1, 2)]
            bad = [start(["actor", *common, "actor.actor_id=stranger", *curve_overrides(keys, "actor", secret_key=stranger)],
                         logs["stranger"]),
                   start(["actor", *common, "actor.actor_id=wrong_server",
                          *curve_overrides(keys, "actor", server_key=other.learner_public)], logs["wrong_server"])]
            procs += good + bad
            assert wait_exit(bad, 120) == [EXIT_CURVE_REFUSED] * 2  # refused, while the learner keeps serving
            assert learner.poll() is None
            assert plain_client_gets_no_reply(ports[0])
            codes = wait_exit([learner, *good], 240)
            assert codes == [0, 0, 0], codes

        metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        assert [r["step"] for r in metrics] == [1, 2]
        text = {n: open(p).read() for n, p in logs.items()}
        assert "actor a1 registered" in text["learner"] and "actor a2 registered" in text["learner"]
        assert "stranger registered" not in text["learner"] and "wrong_server registered" not in text["learner"]
        assert "(CURVE)" in text["learner"]
        assert ("refused this actor's CURVE key (actor.curve.secret_key=" + stranger) in text["stranger"]
        assert "add its public key to the learner's learner.curve.authorized folder" in text["stranger"]
        assert "refused a CURVE client with public key " + load_secret(stranger)[0].decode() in text["learner"]
        assert "is probably not this learner's public key" in text["wrong_server"]
        assert other.learner_public in text["wrong_server"]
        assert "Traceback" not in text["stranger"] + text["wrong_server"]
    except BaseException:
        for n, p in logs.items():
            if os.path.exists(p):
                print(f"===== {n}\n" + open(p).read()[-4000:])
        raise
    finally:
        for p in procs:
            end(p)
