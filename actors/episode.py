"""Episode runner: env reset -> (generate -> parse -> env step -> observation delta)* -> Episode.

Token stream invariant: ``Episode.token_ids`` = ``renderer.initial`` ids, then per turn
the engine's sampled ids verbatim (``loss_mask`` 1, their behaviour log-probs and
versions) and the renderer's observation delta (``loss_mask`` 0, log-prob 0, version -1).
Each prompt is the previous prompt plus sampled ids plus delta, so it extends the
previous one by construction; ``Renderer.extend`` checks that against the chat template.

Phases and state.  ``run_episode`` builds an ``EpisodeContext`` (what the episode plays
with: engine, renderer, env session, parser, sampling, turn limit, seed, stop ids) and an
``EpisodeState`` (what it has built so far: the token stream and its per-token columns, the
chat messages, the turns, reward and success), then runs the phases on them.  A phase ends
the episode by raising ``EpisodeEnd(reason, error)``; the state becomes the ``Episode``
with that ``finish_reason`` (``error`` keeps the env's or the engine's text).  In order:

1. ``_begin``: env reset (``env_error``), initial prompt rendered (``render_error``);
2. each turn ``i < turn_limit`` (``_play_turn``, the turn in play is a ``TurnState``):
   ``_generate``: ``context_limit`` (no room left under ``sampling.max_context_tokens`` to
   generate), ``aborted`` (the engine aborted or failed); parse, then the env step
   (``env_error``: any exception from the env, after the turn is recorded); the turn is
   recorded, then ``done`` (the env reached a terminal state) or ``truncated`` (the env
   cut the episode at its own time limit: not terminal, so GAE bootstraps from the critic
   there); unless it was the last turn, ``_observe`` appends the observation's delta
   (``render_error``: ``RenderError``; ``context_limit``: the next observation would not fit);
3. every turn played: ``turn_limit`` (the lease's limit was reached).

A parse failure is an ordinary turn: the env is not stepped and the parser's hint becomes
the observation (reward 0).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Awaitable, Callable, Protocol

import numpy as np

from turnscale.actors.engine import Engine, EngineError, GenerateRequest
from turnscale.common.parsing import ActionParser
from turnscale.common.prompts import initial_messages
from turnscale.common.renderer import Renderer, RenderError
from turnscale.protocol.arena import Arena, BlockSizer
from turnscale.protocol.messages import Episode, Lease, SamplingParams, Task, TrajectoryGroup, Turn


class EnvSession(Protocol):
    """One env instance, reused across episodes (envhub client or an in-process env)."""

    async def reset(self, data_idx: int) -> tuple[str, dict]:
        """Start the episode; returns the first observation and info."""

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        """Apply ``action``; returns observation, reward, done, info (``info["success"]``)."""


def turn_seed(seed: int, turn: int) -> int:
    """The engine seed of one turn of an episode seeded ``seed``."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFFFFFF, turn]).generate_state(1, np.uint64)[0] >> 1)


class EpisodeEnd(Exception):
    """Raised by a phase to end the episode with ``reason`` (and ``error`` text)."""

    def __init__(self, reason: str, error: str = "") -> None:
        super().__init__(reason, error)
        self.reason, self.error = reason, error


@dataclasses.dataclass(frozen=True)
class EpisodeContext:
    """What an episode plays with; fixed for its whole length."""

    engine: Engine
    renderer: Renderer
    env: EnvSession
    parser: ActionParser
    sampling: SamplingParams
    turn_limit: int
    seed: int
    """The episode's seed; turn ``i`` samples with ``turn_seed(seed, i)``."""
    stop_ids: tuple[int, ...]
    """``renderer.stop_token_ids``: every turn's ``GenerateRequest.stop_token_ids``."""
    arena: Arena | None = None
    """Where the episode's arrays are made (its group's), or None for arrays of their own."""


@dataclasses.dataclass
class EpisodeState:
    """What an episode has built so far: the token stream with its per-token columns, the
    chat messages it renders from, its turns and its reward."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    prompt_len: int = 0
    """Length of the initial prompt (0 until it is rendered)."""
    reward: float = 0.0
    success: bool = False

    def add_sampled(self, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> None:
        self.token_ids += ids.tolist()
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs.tolist()
        self.versions += versions.tolist()

    def add_context(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def episode(self, ctx: EpisodeContext, end: EpisodeEnd) -> Episode:
        """The finished episode; its arrays are carved from ``ctx.arena`` (the group's, so
        the group travels as a few data frames: ``protocol/arena.py``) when there is one."""
        make = ctx.arena.array if ctx.arena is not None else (lambda values, dtype: np.asarray(values, dtype=dtype))
        return Episode(
            token_ids=make(self.token_ids, np.int32),
            loss_mask=make(self.loss_mask, np.uint8),
            logprobs=make(self.logprobs, np.float32),
            versions=make(self.versions, np.int32),
            prompt_len=self.prompt_len,
            turns=self.turns,
            finish_reason=end.reason,
            reward=float(self.reward),
            success=bool(self.success),
            turn_limit=ctx.turn_limit,
            error=end.error,
        )


@dataclasses.dataclass
class TurnState:
    """One turn in play: what the engine sampled, then what the env made of it."""

    index: int
    prompt: list[int]
    """The prompt it continued (the stream before the turn)."""
    token_start: int
    out_ids: list[int]
    stopped: bool
    """The output ended with the renderer's end-of-turn token."""
    text: str
    policy_version: int
    gen_s: float
    # the outcome, set once the env stepped (or the parser refused the text)
    action: str = ""
    parse_error: bool = False
    observation: str = ""
    reward: float = 0.0
    done: bool = False
    env_s: float = 0.0


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
    arena: Arena | None = None,
) -> Episode:
    """Play one episode of ``task``; never raises for env, engine or render failures
    (they become the finish reason); trio cancellation propagates.  ``arena``: where its
    arrays are made (``EpisodeContext.arena``)."""
    ctx = EpisodeContext(engine=engine, renderer=renderer, env=env, parser=parser, sampling=sampling,
                         turn_limit=turn_limit, seed=seed, stop_ids=tuple(renderer.stop_token_ids), arena=arena)
    state = EpisodeState()
    try:
        await _begin(ctx, state, task, prompt)
        for index in range(turn_limit):
            await _play_turn(ctx, state, index)
    except EpisodeEnd as end:
        return state.episode(ctx, end)
    return state.episode(ctx, EpisodeEnd("turn_limit"))


async def _begin(ctx: EpisodeContext, state: EpisodeState, task: Task, prompt: str) -> None:
    """Reset the env and render the initial prompt (``env_error``, ``render_error``)."""
    try:
        obs, _info = await ctx.env.reset(task.data_idx)
    except Exception as exc:
        raise EpisodeEnd("env_error", f"reset failed: {type(exc).__name__}: {exc}") from None
    state.messages = initial_messages(prompt, obs)
    try:
        state.add_context(ctx.renderer.initial(state.messages))
    except RenderError as exc:
        raise EpisodeEnd("render_error", str(exc)) from None
    state.prompt_len = len(state.token_ids)


async def _play_turn(ctx: EpisodeContext, state: EpisodeState, index: int) -> None:
    """One turn: generate, parse, step the env (``env_error``), record the turn (``done``,
    ``truncated``), then extend the prompt with the observation (not after the last turn)."""
    turn = await _generate(ctx, state, index)
    parsed = ctx.parser(turn.text)
    turn.action = parsed.action
    info: dict = {}
    if parsed.ok:
        t1 = time.monotonic()
        try:
            obs, reward, done, info = await ctx.env.step(parsed.action)
        except Exception as exc:
            turn.env_s = time.monotonic() - t1
            state.turns.append(_turn(state, turn))
            raise EpisodeEnd("env_error", f"step failed: {type(exc).__name__}: {exc}") from None
        turn.env_s = time.monotonic() - t1
        turn.observation, turn.reward, turn.done = obs, float(reward), bool(done)
        state.reward += float(reward)
        state.success = state.success or bool(info.get("success", False))
    else:
        turn.parse_error, turn.observation = True, parsed.hint
    state.turns.append(_turn(state, turn))
    if turn.done:
        raise EpisodeEnd("truncated" if info.get("truncated") else "done")
    if index == ctx.turn_limit - 1:
        return
    _observe(ctx, state, turn)


async def _generate(ctx: EpisodeContext, state: EpisodeState, index: int) -> TurnState:
    """Sample the turn's output into the stream (``context_limit``, ``aborted``)."""
    sampling = ctx.sampling
    room = sampling.max_context_tokens - len(state.token_ids)
    if room <= 0:
        raise EpisodeEnd("context_limit")
    sp = sampling if room >= sampling.max_new_tokens else dataclasses.replace(sampling, max_new_tokens=room)
    prev = list(state.token_ids)
    t0 = time.monotonic()
    try:
        res = await ctx.engine.generate(GenerateRequest(prev, sp, ctx.stop_ids, seed=turn_seed(ctx.seed, index)))
    except EngineError as exc:
        raise EpisodeEnd("aborted", f"engine: {exc}") from None
    gen_s = time.monotonic() - t0
    if res.finish_reason == "aborted":
        raise EpisodeEnd("aborted", "engine aborted the request")
    start = len(state.token_ids)
    state.add_sampled(res.token_ids, res.logprobs, res.versions())
    out_ids = res.token_ids.tolist()
    stopped = res.finish_reason == "stop" and bool(out_ids) and out_ids[-1] == ctx.renderer.end_of_turn_id
    text = ctx.renderer.assistant_content(out_ids, stopped)
    return TurnState(index=index, prompt=prev, token_start=start, out_ids=out_ids, stopped=stopped, text=text,
                     policy_version=res.policy_version, gen_s=gen_s)


def _observe(ctx: EpisodeContext, state: EpisodeState, turn: TurnState) -> None:
    """Append the observation's delta to the stream (``render_error``, ``context_limit``)."""
    try:
        delta = ctx.renderer.extend(turn.prompt, turn.out_ids, turn.stopped, turn.observation, messages=state.messages)
    except RenderError as exc:
        raise EpisodeEnd("render_error", str(exc)) from None
    if len(state.token_ids) + len(delta) >= ctx.sampling.max_context_tokens:
        raise EpisodeEnd("context_limit")
    state.add_context(delta)
    state.messages = state.messages + [{"role": "assistant", "content": turn.text}, {"role": "user", "content": turn.observation}]


def _turn(state: EpisodeState, turn: TurnState) -> Turn:
    """The ``Turn`` record of ``turn``; its span ends at the stream's current end."""
    return Turn(
        index=turn.index,
        token_start=turn.token_start,
        token_end=len(state.token_ids),
        output_text=turn.text,
        action=turn.action,
        parse_error=turn.parse_error,
        observation=turn.observation,
        reward=turn.reward,
        done=turn.done,
        policy_version=int(turn.policy_version),
        gen_latency_s=float(turn.gen_s),
        env_latency_s=float(turn.env_s),
    )


SessionSource = Callable[[int], "EnvSession | Awaitable[EnvSession]"]
"""``sessions(i)`` -> the env session episode ``i`` of the group plays on (sync or async)."""

GROUP_BLOCKS = BlockSizer()
"""Sizes each group's arena from this process's recent groups, so a group usually fits
one block and travels as one data frame (``protocol/arena.py``)."""


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
    arena = GROUP_BLOCKS.arena()  # the group's arrays, so it travels as one or a few data frames
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
                arena=arena,
            )
        except Exception as exc:
            crashes.append(f"episode {i}: {type(exc).__name__}: {exc}")

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    GROUP_BLOCKS.observe(arena)
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

