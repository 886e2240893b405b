"""turnscale.actors.main's wiring: the GroupPlayer plays a lease's group; build_actor hands the Actor
typed parts (a RuntimeBuilder whose players stamp the actor's id and follow its latest Welcome)."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from turnscale import conf
from turnscale.actors.actor import Actor, Runtime
from turnscale.actors.main import GroupPlayer, RuntimeBuilder, build_actor, env_client, new_receive_buffer, pull_into
from turnscale.common.prompts import instruction
from turnscale.common.renderer import Renderer
from turnscale.protocol.messages import EnvEndpoint, Lease, PolicyAnnouncement, SamplingParams, Task, Welcome
from tests.unit.test_episode import SP, FakeEngine, FakeEnv
from tests.conftest import tiny_corpus
from turnscale.common.tinymodel import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tiny_corpus(200), 512)


def lease(n: int = 3, seed: int = 5) -> Lease:
    return Lease(lease_id="l-4", task=Task(env="babyai", data_idx=2), group_size=n, turn_limit=3, policy_version=3,
                 ttl_s=10, seed=seed)


def welcome(model_path: str, sampling: SamplingParams) -> Welcome:
    return Welcome(run_id="r", actor_id="a-7", model_path=model_path, renderer="auto", sampling=sampling,
                   envs=[EnvEndpoint(name="babyai", url="http://127.0.0.1:1")], transfer_dtype="float32",
                   pub_endpoint="tcp://127.0.0.1:1", weights_endpoint="tcp://127.0.0.1:2", heartbeat_interval_s=5.0,
                   policy=PolicyAnnouncement(version=0, step=0, manifest=None))


def test_group_player_plays_group_size_episodes_on_their_sessions(tok):
    engine = FakeEngine(tok, ["Action: left", "Action: win"])
    sampling = [SP]
    player = GroupPlayer(engine=engine, renderer=Renderer.for_tokenizer(tok), actor_id="a-7", sampling=lambda: sampling[0])
    envs = [FakeEnv() for _ in range(3)]

    group = trio.run(player.play, lease(3), envs)
    assert not group.failed and group.lease_id == "l-4" and group.actor_id == "a-7" and group.turn_limit == 3
    assert len(group.episodes) == 3 and all(env.actions and env.actions[-1] == "win" for env in envs)
    for ep in group.episodes:  # the engine's version tags every sampled token
        assert ep.finish_reason == "done" and set(ep.versions[ep.loss_mask.astype(bool)].tolist()) == {3}
    # the lease's env chooses the prompt: babyai's instruction opens every episode
    assert instruction("babyai")[:40] in tok.decode(engine.requests[0].prompt_ids)
    assert {r.sampling.max_new_tokens for r in engine.requests} == {SP.max_new_tokens}

    # the sampling is read per group (a newer Welcome's applies to the next group)
    sampling[0] = dataclasses.replace(SP, max_new_tokens=3)
    before = len(engine.requests)
    group = trio.run(player.play, lease(2), [FakeEnv(), FakeEnv()])
    assert len(group.episodes) == 2
    assert {r.sampling.max_new_tokens for r in engine.requests[before:]} == {3}


def test_group_player_refuses_an_env_it_has_no_parser_for(tok):
    player = GroupPlayer(engine=FakeEngine(tok, ["Action: win"]), renderer=Renderer.for_tokenizer(tok), actor_id="a",
                         sampling=lambda: SP)
    bad = dataclasses.replace(lease(1), task=Task(env="no-such-env", data_idx=0))
    env = FakeEnv()
    with pytest.raises(ValueError, match="no-such-env"):  # the actor's _play makes it a failed group
        trio.run(player.play, bad, [env])
    assert env.actions == []


def test_build_actor_wires_typed_parts_that_follow_the_latest_welcome(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    cfg = conf.load(["engine=sim", "actor.actor_id=a-7"])
    actor = build_actor(cfg)
    assert isinstance(actor, Actor) and actor.actor_id == "a-7" and actor.engine_name == "sim"
    assert actor.device == cfg.engine.device
    deps = actor.deps
    assert isinstance(deps.make_runtime, RuntimeBuilder) and deps.make_runtime.actor_id == "a-7"
    assert deps.make_env_client is env_client and deps.pull is pull_into and deps.new_buffer is new_receive_buffer
    assert deps.new_buffer() is not None
    batching = build_actor(conf.load(["engine=sim", "actor.env_batch_steps=true"])).deps.make_env_client
    assert batching("http://127.0.0.1:9", "turnscale")._batcher is not None
    assert batching("http://127.0.0.1:9", "agentgym")._batcher is None  # AgentGym's servers have no batch route
    assert env_client("http://127.0.0.1:9", "turnscale")._batcher is None

    first = welcome(str(tmp_path), dataclasses.replace(SP, max_new_tokens=4))
    actor.welcome = first
    runtime = trio.run(deps.make_runtime, first)
    assert isinstance(runtime, Runtime)
    player = runtime.play_group.__self__
    assert isinstance(player, GroupPlayer) and player.engine is runtime.engine and player.actor_id == "a-7"
    assert player.sampling() == first.sampling
    group = trio.run(runtime.play_group, lease(2), [FakeEnv(), FakeEnv()])
    assert group.actor_id == "a-7" and len(group.episodes) == 2 and not group.failed
    for ep in group.episodes:
        assert all(t.token_end - t.token_start <= 4 for t in ep.turns)
    # a reconnect adopts another Welcome; the runtime stays and its player follows
    actor.welcome = welcome(str(tmp_path), dataclasses.replace(SP, max_new_tokens=7))
    assert player.sampling().max_new_tokens == 7
    runtime.engine.close()


def test_build_actor_draws_an_id_when_none_is_configured():
    a, b = build_actor(conf.load(["engine=sim"])), build_actor(conf.load(["engine=sim"]))
    assert a.actor_id and a.actor_id != b.actor_id
    assert a.deps.make_runtime.actor_id == a.actor_id
