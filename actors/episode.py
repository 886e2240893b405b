"""Episode runner: env reset -> (generate -> parse -> env step -> observation delta)* -> Episode.

Token stream invariant: ``Episode.token_ids`` = ``renderer.initial`` ids, then per turn
the engine's sampled ids verbatim (``loss_mask`` 1, their behaviour log-probs and
versions) and the renderer's observation delta (``loss_mask`` 0, log-prob 0, version -1).
Each prompt is the previous prompt plus sampled ids plus delta, so it extends the
previous one by construction; ``Renderer.extend`` checks that against the chat template.

Ending (``finish_reason``), checked in this order each turn:
``context_limit`` (no room left under ``sampling.max_context_tokens`` to generate, or
the next observation would not fit), ``aborted`` (the engine aborted or failed),
``env_error`` (any exception from the env; its text is kept in ``error``),
``render_error`` (``RenderError``), ``done`` (the env reached a terminal state),
``truncated`` (the env cut the episode at its own time limit: not terminal, so GAE
bootstraps from the critic there), ``turn_limit`` (the lease's limit was reached).  A parse failure is an ordinary turn: the env is not
stepped and the parser's hint becomes the observation (reward 0).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Awaitable, Callable, Protocol

import numpy as np

from actors.engine import Engine, EngineError, GenerateRequest
from common.parsing import ActionParser
from common.prompts import initial_messages
from common.renderer import Renderer, RenderError
from protocol.messages import Episode, Lease, SamplingParams, Task, TrajectoryGroup, Turn


class EnvSession(Protocol):
    """One env instance, reused across episodes (envhub client or an in-process env)."""

    async def reset(self, data_idx: int) -> tuple[str, dict]:
        """Start the episode; returns the first observation and info."""

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Apply ``action``; returns observation, reward, done, info (``info["success"]``)."""


def turn_seed(seed: int, turn: int) -> int:
    """The engine seed of one turn of an episode seeded ``seed``."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFFFFFF, turn]).generate_state(1, np.uint64)[0] >> 1)


class _Stream:
    """The growing token stream with its per-token columns."""

    def __init__(self, prompt: list[int]) -> None:
        self.ids = list(prompt)
        self.mask = [0] * len(prompt)
        self.logprobs = [0.0] * len(prompt)
        self.versions = [-1] * len(prompt)

    def add_sampled(self, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> None:
        self.ids += ids.tolist()
        self.mask += [1] * len(ids)
        self.logprobs += logprobs.tolist()
        self.versions += versions.tolist()

    def add_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


async def run_episode(
    *,
    engine: Engine,
    renderer: Renderer,
    env: EnvSession,
    task: Task,
    turn_limit: int,
    sampling: SamplingParams,
    parser: ActionParser,
    prompt: str,
    seed: int,
) -> Episode:
    """Play one episode of ``task``; never raises for env, engine or render failures
    (they become the finish reason); trio cancellation propagates."""
    stream = _Stream([])
    turns: list[Turn] = []
    total, success = 0.0, False

    def finish(reason: str, error: str = "") -> Episode:
        return Episode(
            token_ids=np.asarray(stream.ids, dtype=np.int32),
            loss_mask=np.asarray(stream.mask, dtype=np.uint8),
            logprobs=np.asarray(stream.logprobs, dtype=np.float32),
            versions=np.asarray(stream.versions, dtype=np.int32),
            prompt_len=prompt_len,
            turns=turns,
            finish_reason=reason,
            reward=float(total),
            success=bool(success),
            turn_limit=turn_limit,
            error=error,
        )

    prompt_len = 0
    try:
        obs, _info = await env.reset(task.data_idx)
    except Exception as exc:
        return finish("env_error", f"reset failed: {type(exc).__name__}: {exc}")
    messages = initial_messages(prompt, obs)
    try:
        stream.add_context(renderer.initial(messages))
    except RenderError as exc:
        return finish("render_error", str(exc))
    prompt_len = len(stream.ids)
    stop_ids = tuple(renderer.stop_token_ids)

    for index in range(turn_limit):
        room = sampling.max_context_tokens - len(stream.ids)
        if room <= 0:
            return finish("context_limit")
        sp = sampling if room >= sampling.max_new_tokens else dataclasses.replace(sampling, max_new_tokens=room)
        prev = list(stream.ids)
        t0 = time.monotonic()
        try:
            res = await engine.generate(GenerateRequest(prev, sp, stop_ids, seed=turn_seed(seed, index)))
        except EngineError as exc:
            return finish("aborted", f"engine: {exc}")
        gen_s = time.monotonic() - t0
        if res.finish_reason == "aborted":
            return finish("aborted", "engine aborted the request")
        start = len(stream.ids)
        stream.add_sampled(res.token_ids, res.logprobs, res.versions())
        out_ids = res.token_ids.tolist()
        stopped = res.finish_reason == "stop" and bool(out_ids) and out_ids[-1] == renderer.end_of_turn_id
        text = renderer.assistant_content(out_ids, stopped)
        parsed = parser(text)
        reward, done, env_s = 0.0, False, 0.0
        if parsed.ok:
            t1 = time.monotonic()
            try:
                obs, reward, done, info = await env.step(parsed.action)
            except Exception as exc:
                turns.append(_turn(index, start, stream, text, parsed.action, False, "", 0.0, False, res.policy_version, gen_s, time.monotonic() - t1))
                return finish("env_error", f"step failed: {type(exc).__name__}: {exc}")
            env_s = time.monotonic() - t1
            total += float(reward)
            success = success or bool(info.get("success", False))
        else:
            obs = parsed.hint
        turns.append(_turn(index, start, stream, text, parsed.action, not parsed.ok, obs, float(reward), bool(done), res.policy_version, gen_s, env_s))
        if done:
            return finish("truncated" if info.get("truncated") else "done")
        if index == turn_limit - 1:
            break
        try:
            delta = renderer.extend(prev, out_ids, stopped, obs, messages=messages)
        except RenderError as exc:
            return finish("render_error", str(exc))
        if len(stream.ids) + len(delta) >= sampling.max_context_tokens:
            return finish("context_limit")
        stream.add_context(delta)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
    return finish("turn_limit")


def _turn(index, start, stream, text, action, parse_error, obs, reward, done, version, gen_s, env_s) -> Turn:
    return Turn(
        index=index,
        token_start=start,
        token_end=len(stream.ids),
        output_text=text,
        action=action,
        parse_error=parse_error,
        observation=obs,
        reward=reward,
        done=done,
        policy_version=int(version),
        gen_latency_s=float(gen_s),
        env_latency_s=float(env_s),
    )


SessionSource = Callable[[int], "EnvSession | Awaitable[EnvSession]"]
"""``sessions(i)`` -> the env session episode ``i`` of the group plays on (sync or async)."""


async def run_group(
    *,
    engine: Engine,
    renderer: Renderer,
    sessions: SessionSource,
    lease: Lease,
    actor_id: str,
    sampling: SamplingParams,
    parser: ActionParser,
    prompt: str,
) -> TrajectoryGroup:
    """Play ``lease.group_size`` episodes of ``lease.task`` concurrently, one session each.

    Episode ``i`` is seeded ``(lease.seed, i)``.  The group is ``failed`` when any episode
    is untrainable (``env_error``, ``render_error``, ``aborted``) or raised unexpectedly;
    ``error`` names the first such episode.  Cancellation propagates.
    """
    import trio

    n = lease.group_size
    episodes: list[Episode | None] = [None] * n
    crashes: list[str] = []

    async def one(i: int) -> None:
        try:
            env = sessions(i)
            if inspect.isawaitable(env):
                env = await env
            episodes[i] = await run_episode(
                engine=engine,
                renderer=renderer,
                env=env,
                task=lease.task,
                turn_limit=lease.turn_limit,
                sampling=sampling,
                parser=parser,
                prompt=prompt,
                seed=episode_seed(lease.seed, i),
            )
        except Exception as exc:
            crashes.append(f"episode {i}: {type(exc).__name__}: {exc}")

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    done = [ep for ep in episodes if ep is not None]
    errors = list(crashes) + [f"episode {i}: {ep.finish_reason}: {ep.error}" for i, ep in enumerate(episodes) if ep is not None and not ep.trainable]
    return TrajectoryGroup(
        lease_id=lease.lease_id,
        actor_id=actor_id,
        task=lease.task,
        turn_limit=lease.turn_limit,
        episodes=done,
        failed=bool(errors),
        error=errors[0] if errors else "",
    )


def episode_seed(group_seed: int, i: int) -> int:
    """Seed of episode ``i`` of a group seeded ``group_seed``."""
    return int(np.random.SeedSequence([group_seed & 0xFFFFFFFFFFFF, i, 1]).generate_state(1, np.uint64)[0] >> 1)

