"""CURVE: key files (``protocol.curve``, ``turnscale keys``), the loopback rule and the
role configs (``common.curve``), the learner's ZAP authenticator, and the actor's
handshake monitor against the real learner service (fake trainer) over 127.0.0.1:
authorized actors train, an unauthorized one, one holding another learner's public key
and a plain one are each refused with a clear error and exit code 3."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

import pytest
import trio
import zmq
import zmq.auth

from turnscale import conf
from turnscale.actors.actor import EXIT_CURVE_REFUSED
from turnscale.common.curve import CurveConfigError, actor_curve, curve_on, learner_curve
from turnscale.learner.service import LearnerService, ServiceParts
from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.curve import ZapAuthenticator, create_keys, create_pair, is_loopback, load_authorized, load_secret
from turnscale.protocol.transport import AsyncSocket, Requester, configure, tcp_endpoint
from tests.integration.curvekeys import curve_overrides
from tests.unit.checksum_engine import ChecksumEngine
from tests.unit.test_actor_loop import SIZE, FakeEnvClient, make_actor
from tests.unit.test_learner_service import FakePublisher, FakeSchedule, FakeTrainer, make_cfg

# ----------------------------------------------------------------------------- key files


def test_create_keys_writes_pyzmq_certificates_secrets_0600_and_an_authorized_folder(tmp_path):
    d = str(tmp_path / "keys")
    ks = create_keys(d, actors=2)
    names = sorted(os.listdir(d))
    assert names == ["actor-1.key", "actor-1.key_secret", "actor-2.key", "actor-2.key_secret", "authorized",
                     "learner.key", "learner.key_secret"]
    assert sorted(os.listdir(ks.authorized)) == ["actor-1.key", "actor-2.key"]
    for name in ("learner.key_secret", "actor-1.key_secret", "actor-2.key_secret"):
        assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    pub, sec = zmq.auth.load_certificate(ks.learner_secret)  # pyzmq reads them
    assert len(pub) == len(sec) == 40 and zmq.auth.load_certificate(ks.learner_public) == (pub, None)
    assert zmq.curve_public(sec) == pub
    a1 = load_secret(ks.actor_secrets[0])
    assert load_authorized(ks.authorized) == {a1[0], load_secret(ks.actor_secrets[1])[0]}
    assert pub not in load_authorized(ks.authorized)  # the learner is not a client


def test_create_keys_refuses_to_replace_the_learner_key_unless_forced(tmp_path):
    d = str(tmp_path / "keys")
    first = load_secret(create_keys(d).learner_secret)
    with pytest.raises(FileExistsError, match="--force"):
        create_keys(d)
    assert load_secret(os.path.join(d, "learner.key_secret")) == first
    assert load_secret(create_keys(d, force=True).learner_secret) != first


def test_turnscale_keys_command(tmp_path):
    d = str(tmp_path / "k")
    p = subprocess.run([sys.executable, "-m", "turnscale", "keys", d, "--actors", "3"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "learner.curve.secret_key=" in p.stdout and p.stdout.count("actor.curve.secret_key=") == 3
    assert len(os.listdir(os.path.join(d, "authorized"))) == 3
    again = subprocess.run([sys.executable, "-m", "turnscale", "keys", d], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--force" in again.stderr


# ----------------------------------------------------------------------------- the auto rule


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST", "a.localhost"])
def test_loopback_hosts_leave_curve_off_on_auto(host):
    assert is_loopback(host) and not curve_on("auto", host)
    assert curve_on("true", host)


@pytest.mark.parametrize("host", ["10.0.0.5", "192.168.1.2", "0.0.0.0", "*", "::", "learner.example", "fd00::1"])
def test_other_hosts_turn_curve_on_on_auto(host):
    assert not is_loopback(host) and curve_on("auto", host)
    assert not curve_on("false", host)


@pytest.mark.parametrize("given,want", [("true", "true"), ("false", "false"), ("auto", "auto"), ("on", "true"),
                                        ("off", "false"), ("True", "true")])
def test_curve_enabled_values(given, want):
    cfg = conf.load([f"learner.curve.enabled={given}", f"actor.curve.enabled={given}"])
    assert cfg.learner.curve.enabled == want == cfg.actor.curve.enabled


def test_curve_enabled_rejects_other_values():
    with pytest.raises(conf.ConfigError, match="learner.curve.enabled"):
        conf.load(["learner.curve.enabled=maybe"])


def test_defaults_are_auto_and_off_on_loopback():
    cfg = conf.load([])
    assert cfg.learner.curve.enabled == "auto" == cfg.actor.curve.enabled
    assert learner_curve(cfg.learner) is None and actor_curve(cfg.actor) is None


# ----------------------------------------------------------------------------- role configs


def test_curve_on_without_key_files_names_the_key_and_the_keys_command(tmp_path):
    cfg = conf.load(["learner.host=10.1.2.3", "actor.learner_host=10.1.2.3"])  # auto: on
    with pytest.raises(CurveConfigError, match=r"learner.curve.secret_key.*turnscale keys"):
        learner_curve(cfg.learner)
    with pytest.raises(CurveConfigError, match=r"actor.curve.secret_key.*turnscale keys"):
        actor_curve(cfg.actor)
    ks = create_keys(str(tmp_path / "k"))
    cfg = conf.load(["learner.host=10.1.2.3", f"learner.curve.secret_key={ks.learner_secret}"])
    with pytest.raises(CurveConfigError, match="learner.curve.authorized"):
        learner_curve(cfg.learner)
    cfg = conf.load(["actor.learner_host=10.1.2.3", f"actor.curve.secret_key={ks.actor_secrets[0]}",
                     f"actor.curve.server_key={tmp_path / 'nope.key'}"])
    with pytest.raises(CurveConfigError, match=r"actor.curve.server_key.*nope.key"):
        actor_curve(cfg.actor)
    cfg = conf.load(["actor.learner_host=10.1.2.3", f"actor.curve.secret_key={ks.learner_public}",  # a public cert
                     f"actor.curve.server_key={ks.learner_public}"])
    with pytest.raises(CurveConfigError, match="only a public key"):
        actor_curve(cfg.actor)


@pytest.mark.parametrize("role", ["learner", "actor"])
def test_role_exits_2_with_a_clear_message_when_a_key_file_is_missing(tmp_path, role):
    p = subprocess.run([sys.executable, "-m", "turnscale", role, f"{role}.curve.enabled=true",
                        f"{role}.curve.secret_key={tmp_path / 'missing.key_secret'}"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"{role}.curve.secret_key" in p.stderr and "turnscale keys" in p.stderr and "Traceback" not in p.stderr


def test_setups_from_files_and_overrides(tmp_path):
    keys = str(tmp_path / "k")
    ks = create_keys(keys, actors=1)
    cfg = conf.load(["learner.host=0.0.0.0", *curve_overrides(keys, "learner", enabled="auto"),
                     "actor.learner_host=10.0.0.1", *curve_overrides(keys, "actor", actor=1, enabled="auto")])
    ls, as_ = learner_curve(cfg.learner), actor_curve(cfg.actor)
    assert ls is not None and as_ is not None
    assert ls.server().public == as_.server_public == zmq.auth.load_certificate(ks.learner_public)[0]
    assert ls.server().server_public == b"" and ls.authorized == ks.authorized
    c = as_.client()
    assert (c.public, c.secret) == load_secret(ks.actor_secrets[0]) and c.server_public == as_.server_public
    other = zmq.curve_keypair()[0]
    assert as_.client(other).server_public == other  # a relay socket to another actor


def test_curve_false_off_loopback_is_logged_as_insecure(caplog):
    cfg = conf.load(["learner.host=10.0.0.2", "learner.curve.enabled=false"])
    with caplog.at_level(logging.WARNING, logger="turnscale.curve"):
        assert learner_curve(cfg.learner) is None
    assert "INSECURE" in caplog.text and "learner.curve.enabled=false" in caplog.text


# ----------------------------------------------------------------------------- ZAP


def test_zap_admits_authorized_keys_logs_refusals_and_rereads_the_folder(tmp_path, caplog):
    keys = str(tmp_path / "k")
    ks = create_keys(keys, actors=1)
    lpub, lsec = load_secret(ks.learner_secret)
    stranger_pub, stranger_sec = load_secret(create_pair(str(tmp_path), "stranger")[1])
    ctx = zmq.Context()
    auth = ZapAuthenticator(ctx, ks.authorized, logging.getLogger("test.zap"))
    try:
        from turnscale.protocol.transport import CurveKeys

        router = configure(ctx.socket(zmq.ROUTER), curve=CurveKeys(lpub, lsec), server=True)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        def dealer(pub, sec):
            d = configure(ctx.socket(zmq.DEALER), curve=CurveKeys(pub, sec, lpub))
            d.connect(tcp_endpoint("127.0.0.1", port))
            return d

        async def main():
            with trio.fail_after(30):
                r = AsyncSocket(router)

                async def answer(n):
                    for _ in range(n):
                        frames = await r.recv_multipart()
                        await r.send_multipart([frames[0], frames[1], *codec.encode(m.HeartbeatAck(unknown_lease_ids=[]))])

                async def ask(sock):
                    with trio.move_on_after(1.5):
                        return await Requester(AsyncSocket(sock)).request(m.Heartbeat(actor_id="a", lease_ids=[], policy_version=0),
                                                                          timeout_s=1.5)
                    return None

                async with trio.open_nursery() as n:
                    n.start_soon(answer, 2)
                    assert isinstance(await ask(dealer(*load_secret(ks.actor_secrets[0]))), m.HeartbeatAck)
                    with caplog.at_level(logging.WARNING, logger="test.zap"):
                        assert await ask(dealer(stranger_pub, stranger_sec)) is None  # refused
                    assert "refused a CURVE client" in caplog.text and stranger_pub.decode() in caplog.text
                    plain = configure(ctx.socket(zmq.DEALER))
                    plain.connect(tcp_endpoint("127.0.0.1", port))
                    assert await ask(plain) is None  # no CURVE, no reply
                    # the operator adds the key: accepted without a restart
                    os.rename(str(tmp_path / "stranger.key"), os.path.join(ks.authorized, "stranger.key"))
                    await trio.sleep(1.1)
                    assert isinstance(await ask(dealer(stranger_pub, stranger_sec)), m.HeartbeatAck)

        trio.run(main)
    finally:
        auth.stop()
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- actors against a CURVE learner


def test_authorized_actor_trains_while_wrong_keys_and_plain_actors_are_refused_with_exit_3(tmp_path, caplog):
    keys = str(tmp_path / "k")
    ks = create_keys(keys, actors=1)
    other_learner = create_keys(str(tmp_path / "other"), actors=0)
    stranger_secret = create_pair(str(tmp_path), "stranger")[1]
    cfg = make_cfg(**{"learner.steps": 2, "learner.max_staleness": 1, "learner.heartbeat_interval_s": 0.05})
    lc = conf.load([*curve_overrides(keys, "learner")]).learner
    setup = learner_curve(lc)
    assert setup is not None
    ctx = zmq.Context()
    auth = ZapAuthenticator(ctx, setup.authorized, logging.getLogger("turnscale.learner"))
    svc = LearnerService(cfg, ServiceParts(trainer=FakeTrainer(), publisher=FakePublisher(), weights=dict,
                                           schedule=FakeSchedule(), curve=setup.server(), context=ctx))
    svc.linger_s, svc.announce_every_s = 0.5, 0.2

    def actor_with(**curve):
        cfg_a = make_cfg(**{"learner.port": cfg.learner.port, **{f"actor.curve.{k}": v for k, v in curve.items()}})
        a = make_actor(cfg_a, FakeEnvClient(), ChecksumEngine(size=SIZE))
        a.curve = actor_curve(a.cfg)
        return a

    good = actor_with(enabled="true", server_key=ks.learner_public, secret_key=ks.actor_secrets[0])
    stranger = actor_with(enabled="true", server_key=ks.learner_public, secret_key=stranger_secret)
    wrong_server = actor_with(enabled="true", server_key=other_learner.learner_public, secret_key=ks.actor_secrets[0])
    plain = actor_with(enabled="false")
    codes = {}

    async def run_one(name, a):
        codes[name] = await a.run()

    async def main():
        with trio.fail_after(180):  # generous: a loaded machine; every wait below is an event
            async with trio.open_nursery() as n:
                n.start_soon(svc.serve)
                await svc.ready.wait()
                for name, a in (("stranger", stranger), ("wrong_server", wrong_server), ("plain", plain)):
                    n.start_soon(run_one, name, a)
                # the refused actors must meet the learner while it serves: the good actor's
                # run ends it after two steps, and an actor that then finds no learner at all
                # retries (it cannot tell a refusal from a learner not up yet)
                while len(codes) < 3:
                    await trio.sleep(0.05)
                codes["good"] = await good.run()

    try:
        with caplog.at_level(logging.INFO):
            trio.run(main)
    finally:
        auth.stop()
        ctx.destroy(linger=0)
    assert codes == {"good": 0, "stranger": EXIT_CURVE_REFUSED, "wrong_server": EXIT_CURVE_REFUSED,
                     "plain": EXIT_CURVE_REFUSED}, codes
    assert svc.step == 2 and good.stats.groups_accepted >= 4
    text = caplog.text
    assert "refused this actor's CURVE key (actor.curve.secret_key=" + stranger_secret in text
    assert "add its public key to the learner's learner.curve.authorized folder" in text
    assert "is probably not this learner's public key" in text and other_learner.learner_public in text
    assert "requires CURVE" in text and "actor.curve.server_key= " not in text
    assert "refused a CURVE client with public key " + load_secret(stranger_secret)[0].decode() in text
