"""run_episode / run_group with a scripted fake engine and fake env sessions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio

from turnscale.actors.engine import EngineError, GenerateRequest, GenerateResult
from turnscale.actors.episode import run_episode, run_group
from turnscale.common.parsing import parse_action_line
from turnscale.common.renderer import Renderer
from turnscale.protocol import codec
from turnscale.protocol.messages import Lease, SamplingParams, Task, TrajectoryGroup
from tests.conftest import tiny_corpus
from turnscale.common.tinymodel import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tiny_corpus(200), 512)


class FakeEngine:
    """Replies with scripted texts (tokenized + end-of-turn), log-prob -0.5, version 3."""

    def __init__(self, tok, texts, *, eos=True, fail_at=None):
        self.tok, self.texts, self.eos, self.fail_at = tok, list(texts), eos, fail_at
        self.requests: list[GenerateRequest] = []
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.requests.append(req)
        if self.fail_at is not None and len(self.requests) > self.fail_at:
            raise EngineError("boom")
        await trio.sleep(0)
        text = self.texts[min(len(self.requests) - 1, len(self.texts) - 1)]
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.eot] if self.eos else [])
        ids = ids[: req.sampling.max_new_tokens]
        reason = "stop" if self.eos and ids[-1] == self.eot else "length"
        return GenerateResult(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), reason, 3, 0.01)


class FakeEnv:
    """Done with reward 1 after the action ``win``; raises on ``crash``."""

    def __init__(self, obs="Your goal: win"):
        self.obs, self.actions = obs, []

    async def reset(self, data_idx):
        if data_idx < 0:
            raise RuntimeError("no such task")
        return self.obs, {}

    async def step(self, action):
        self.actions.append(action)
        if action == "crash":
            raise ConnectionError("env server gone")
        return f"you did {action}", (1.0 if action == "win" else 0.0), action == "win", {"success": action == "win"}


SP = SamplingParams(max_new_tokens=32, max_context_tokens=512)


def play(tok, texts, *, env=None, turn_limit=5, sampling=SP, data_idx=0, **kw):
    engine = FakeEngine(tok, texts, **kw)
    env = env or FakeEnv()
    ep = trio.run(lambda: run_episode(
        engine=engine, renderer=Renderer.for_tokenizer(tok), env=env, task=Task(env="babyai", data_idx=data_idx),
        turn_limit=turn_limit, sampling=sampling, parser=parse_action_line, prompt="Play.", seed=1))
    return ep, engine, env


def test_done_episode_records_tokens_turns_and_reward(tok):
    ep, engine, env = play(tok, ["Thought: a\nAction: left", "no action here", "Action: win"])
    assert ep.finish_reason == "done" and ep.reward == 1.0 and ep.success
    assert [t.action for t in ep.turns] == ["left", "", "win"]
    assert [t.parse_error for t in ep.turns] == [False, True, False]
    assert env.actions == ["left", "win"]  # the parse failure never reached the env
    assert "Invalid format" in ep.turns[1].observation
    # every prompt the engine saw is a prefix of the final stream
    for req in engine.requests:
        assert list(ep.token_ids[: len(req.prompt_ids)]) == list(req.prompt_ids)
    # mask is 1 exactly on the sampled spans; log-probs and versions only there
    sampled = np.zeros(len(ep.token_ids), bool)
    for t in ep.turns:
        sampled[t.token_start:t.token_end] = True
    assert (ep.loss_mask.astype(bool) == sampled).all()
    assert (ep.logprobs[sampled] == -0.5).all() and (ep.logprobs[~sampled] == 0).all()
    assert (ep.versions[sampled] == 3).all() and (ep.versions[~sampled] == -1).all()
    assert ep.prompt_len == len(engine.requests[0].prompt_ids)


def test_episode_survives_a_codec_round_trip(tok):
    ep, _, _ = play(tok, ["Action: left", "Action: win"])
    group = TrajectoryGroup(lease_id="l-1", actor_id="a", task=Task(env="babyai", data_idx=0), turn_limit=5, episodes=[ep])
    back = codec.decode(codec.encode(group))
    got = back.episodes[0]
    for name in ("token_ids", "loss_mask", "logprobs", "versions"):
        assert np.array_equal(getattr(got, name), getattr(ep, name))
    assert got.turns == ep.turns and got.finish_reason == "done"


def test_turn_limit_ends_the_episode(tok):
    ep, engine, _ = play(tok, ["Action: left"], turn_limit=3)
    assert ep.finish_reason == "turn_limit" and len(ep.turns) == 3 and len(engine.requests) == 3
    assert ep.turn_limit == 3 and ep.trainable


def test_context_limit_ends_the_episode(tok):
    ep, _, _ = play(tok, ["Action: left"], turn_limit=50, sampling=dataclasses.replace(SP, max_context_tokens=120))
    assert ep.finish_reason == "context_limit"
    assert len(ep.token_ids) <= 120 and ep.trainable


def test_env_error_is_kept_and_untrainable(tok):
    ep, _, _ = play(tok, ["Action: left", "Action: crash"])
    assert ep.finish_reason == "env_error" and "env server gone" in ep.error and not ep.trainable
    ep, _, _ = play(tok, ["Action: left"], data_idx=-1)
    assert ep.finish_reason == "env_error" and "no such task" in ep.error


def test_engine_failure_aborts_the_episode(tok):
    ep, _, _ = play(tok, ["Action: left"], fail_at=1)
    assert ep.finish_reason == "aborted" and "boom" in ep.error


def test_output_without_eos_gets_end_of_turn_appended_unmasked(tok):
    ep, _, _ = play(tok, ["Action: left", "Action: win"], eos=False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    t0 = ep.turns[0]
    assert ep.token_ids[t0.token_end] == eot and ep.loss_mask[t0.token_end] == 0


def test_run_group_plays_every_episode_on_its_own_session(tok):
    envs = [FakeEnv() for _ in range(4)]
    lease = Lease(lease_id="l-9", task=Task(env="babyai", data_idx=3), group_size=4, turn_limit=4, policy_version=3, ttl_s=10, seed=5)

    async def main(engine, sessions):
        return await run_group(engine=engine, renderer=Renderer.for_tokenizer(tok), sessions=sessions, lease=lease,
                               actor_id="a1", sampling=SP, parser=parse_action_line, prompt="Play.")

    group = trio.run(main, FakeEngine(tok, ["Action: a", "Action: win"]), lambda i: envs[i])
    assert not group.failed and len(group.episodes) == 4 and group.lease_id == "l-9"
    assert all(env.actions for env in envs)
    codec.decode(codec.encode(group))

    async def session(i):
        return FakeEnv() if i != 2 else CrashEnv()

    class CrashEnv(FakeEnv):
        async def step(self, action):
            raise ConnectionError("down")

    group = trio.run(main, FakeEngine(tok, ["Action: a"]), session)
    assert group.failed and "env_error" in group.error and len(group.episodes) == 4
    codec.decode(codec.encode(group))


def test_template_break_ends_the_episode_as_render_error():
    from tests.unit.test_renderer import COUNTING_TEMPLATE

    bad = build_tokenizer(tiny_corpus(100), 400, chat_template=COUNTING_TEMPLATE)
    ep, engine, env = play(bad, ["Action: left"])
    assert ep.finish_reason == "render_error" and "does not extend" in ep.error and not ep.trainable
    assert len(ep.turns) == 1 and len(engine.requests) == 1  # no prompt built from a broken template
    group = TrajectoryGroup(lease_id="l", actor_id="a", task=Task(env="babyai", data_idx=0), turn_limit=5, episodes=[ep], failed=True, error=ep.error)
    assert codec.decode(codec.encode(group)).episodes[0].finish_reason == "render_error"


def test_an_env_time_limit_ends_the_episode_as_truncated_not_done(tok):
    """The env's own time limit (``truncated`` on the wire) is a cut, not a terminal state:
    the episode ends as ``truncated`` (trainable; GAE bootstraps there), never as ``done``."""
    from turnscale.actors.envpool import PooledSession

    class TimeLimitClient:
        async def create(self):
            return 1

        async def reset(self, env_id, data_idx):
            return {"observation": "Your goal: win", "info": {}}

        async def step(self, env_id, action):
            return {"observation": "time is up", "reward": 0.0, "done": False, "truncated": True, "info": {}}

        async def close(self, env_id):
            return True

    ep, _, _ = play(tok, ["Action: left"], env=PooledSession(TimeLimitClient(), 1))
    assert ep.finish_reason == "truncated" and ep.trainable and len(ep.turns) == 1


def test_an_env_step_failure_records_the_turn_before_ending(tok):
    """The turn whose env step raised is kept (action, no observation, reward 0) and the
    stream ends with its sampled ids: nothing is appended after a failed step."""
    ep, _, env = play(tok, ["Action: left", "Action: crash"])
    assert ep.finish_reason == "env_error" and [t.action for t in ep.turns] == ["left", "crash"]
    last = ep.turns[-1]
    assert last.observation == "" and last.reward == 0.0 and not last.done and not last.parse_error
    assert last.token_end == len(ep.token_ids) and ep.loss_mask[-1] == 1
    assert env.actions == ["left", "crash"]
