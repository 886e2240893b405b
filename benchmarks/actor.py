"""``turnscale bench actor``: actor overhead against the bare engine, in one run.

System: ``run_group`` (renderer with template checks, parser, episode bookkeeping, trio
bridge) plays ``--actor-rounds`` rounds of ``--actor-batch / --actor-group`` concurrent
groups against an instant in-process env, on the ``hf`` engine with the tiny model.
Every ``GenerateRequest`` it sends is recorded.

Baseline: after each actor round, the same engine replays exactly that round's requests
(same prompts, sampling parameters and seeds, hence the same tokens) from ``--actor-batch``
workers, each replaying one episode's turns in order (the dependency the actor has too,
which also lets the engine reuse the previous turn's KV cache as it does for the actor),
with no env, renderer or parser work in between.

Figure: generated tokens/s of the actor over the baseline's (target >= 0.9), from the
round whose ratio is the median (each round's pair runs back to back, so a load burst on
a shared machine spoils one pair, not the figure); per-round ratios and totals are printed.

``engine=...`` overrides pick the engine (default ``hf``), e.g. ``turnscale bench actor
engine=vllm_cpu`` (run from ``.venv-vllm``).  With vLLM the baseline is *bare vLLM*: the
same per-episode request chains driven straight through vLLM's ``add_request`` / ``step``
from one loop (no engine thread, trio bridge, env, renderer or parser), at the same batch
size, with the same sampling parameters and seeds.  vLLM also reports the weight-swap time
(``load_weights`` of the full state until the engine reports the new version, median of
``--actor-swaps``) against a memory copy of the same tensors.
"""

from __future__ import annotations

import argparse
import os
import time

from turnscale.benchmarks.common import Result, result


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--actor-batch", type=int, default=16, help="engine max batch = concurrent episodes")
    parser.add_argument("--actor-group", type=int, default=8, help="episodes per group")
    parser.add_argument("--actor-rounds", type=int, default=9, help="rounds of concurrent groups")
    parser.add_argument("--actor-turns", type=int, default=4, help="turns per episode")
    parser.add_argument("--actor-new-tokens", type=int, default=24, help="max new tokens per turn")
    parser.add_argument("--actor-model", default="tiny", help="model path, or 'tiny' (built once, cached)")
    parser.add_argument("--actor-swaps", type=int, default=5, help="weight swaps timed (engine=vllm)")


class InstantEnv:
    """Never done; answers at once (a checkpoint, no sleep)."""

    async def reset(self, data_idx: int):
        import trio

        await trio.lowlevel.checkpoint()
        return f"Your goal: go to the red ball {data_idx}. You see a wall 2 steps ahead.", {}

    async def step(self, action: str):
        import trio

        await trio.lowlevel.checkpoint()
        return "You see a red ball 1 step ahead and 3 steps left.", 0.0, False, {"success": False}


class Recorder:
    """Engine proxy that records every request and its result (and counts generated tokens)."""

    def __init__(self, engine) -> None:
        self.engine, self.requests, self.tokens = engine, [], 0

    async def generate(self, req):
        res = await self.engine.generate(req)
        self.requests.append((req, res))
        self.tokens += len(res.token_ids)
        return res

    def __getattr__(self, name):  # everything else (version, stats, ...) is the engine's
        return getattr(self.engine, name)


def episode_chains(recorded) -> list[list]:
    """Split recorded ``(request, result)`` pairs into per-episode chains, in turn order:
    a request continues the chain whose last prompt + output is a prefix of its prompt."""
    chains: list[list] = []
    ends: list[tuple[int, ...]] = []
    for req, res in sorted(recorded, key=lambda rr: len(rr[0].prompt_ids)):
        prompt = tuple(req.prompt_ids)
        k = next((i for i, e in enumerate(ends) if len(e) < len(prompt) and prompt[: len(e)] == e), None)
        if k is None:
            chains.append([req])
            ends.append(prompt + tuple(res.token_ids.tolist()))
        else:
            chains[k].append(req)
            ends[k] = prompt + tuple(res.token_ids.tolist())
    return chains


def corpus():
    from turnscale.common.parsing import ACTION_LINE_HINT, BACKTICKS_HINT, TAGS_HINT
    from turnscale.conf.envs import ENVS
    from turnscale.actors.sim_engine import RESPONSES

    import random

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    base = [s.prompt for s in ENVS.values()] + list(RESPONSES) + [ACTION_LINE_HINT, TAGS_HINT, BACKTICKS_HINT]
    words = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(9)) for _ in range(1500)]
    return [f"{t} {i}" for i in range(20) for t in base] + words


def run(args: argparse.Namespace) -> list[Result]:
    import torch
    import trio
    from transformers import AutoTokenizer

    from turnscale.actors.engines import make_engine
    from turnscale.actors.episode import run_group
    from turnscale.common.parsing import parse_action_line
    from turnscale.common.prompts import instruction
    from turnscale.common.renderer import Renderer
    from turnscale.conf.schema import EngineConfig, ModelConfig
    from turnscale.protocol.messages import Lease, SamplingParams, Task
    from turnscale.common.tinymodel import ensure_model

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = ensure_model(ModelConfig(path=args.actor_model), corpus)
    tok = AutoTokenizer.from_pretrained(path)
    renderer = Renderer.for_tokenizer(tok)
    engine_cfg = EngineConfig(name="hf", max_batch=args.actor_batch)
    if getattr(args, "overrides", None):
        import dataclasses

        from turnscale import conf
        engine_cfg = dataclasses.replace(conf.load(args.overrides).engine, max_batch=args.actor_batch)
    engine = make_engine(engine_cfg, path)
    vllm = engine_cfg.name == "vllm"
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.actor_new_tokens, max_context_tokens=4096)
    groups = max(1, args.actor_batch // args.actor_group)
    rec = Recorder(engine)

    async def actor(r: int) -> None:
        """One round: ``groups`` groups at once (round ``r`` seeds its leases)."""
        async with trio.open_nursery() as n:
            for g in range(groups):
                lease = Lease(lease_id=f"l-{r}-{g}", task=Task(env="babyai", data_idx=g), group_size=args.actor_group,
                              turn_limit=args.actor_turns, policy_version=0, ttl_s=600, seed=1000 * r + g)
                n.start_soon(lambda lease=lease: run_group(engine=rec, renderer=renderer, sessions=lambda i: InstantEnv(), lease=lease,
                                                          actor_id="bench", sampling=sampling, parser=parse_action_line,
                                                          prompt=instruction("babyai")))

    async def bare(chains) -> int:
        queue = list(reversed(chains))
        count = 0

        async def worker():
            nonlocal count
            while queue:
                for req in queue.pop():  # one episode's turns in order, as the actor had to
                    res = await engine.generate(req)
                    count += len(res.token_ids)

        async with trio.open_nursery() as n:
            for _ in range(args.actor_batch):
                n.start_soon(worker)
        return count

    actor_s = bare_s = 0.0
    actor_tokens = bare_tokens = 0
    rounds: list[tuple[float, float]] = []  # (actor tok/s, bare tok/s) per round
    try:
        trio.run(actor, 0)  # warm-up
        s0 = engine.stats()
        for r in range(1, args.actor_rounds + 1):  # alternate, so load drift on a shared box hits both sides
            rec.requests, rec.tokens = [], 0
            t = time.perf_counter()
            trio.run(actor, r)
            a_s = time.perf_counter() - t
            t = time.perf_counter()
            if vllm:
                b_tokens = bare_vllm(engine, episode_chains(rec.requests), args.actor_batch)
            else:
                b_tokens = trio.run(bare, episode_chains(rec.requests))
            b_s = time.perf_counter() - t
            rounds.append((rec.tokens / a_s, b_tokens / b_s))
            actor_s, bare_s = actor_s + a_s, bare_s + b_s
            actor_tokens, bare_tokens = actor_tokens + rec.tokens, bare_tokens + b_tokens
        s1 = engine.stats()
        swaps = swap_times(engine, path, args.actor_swaps) if vllm else []
    finally:
        engine.close()
    print(f"bench actor: actor {actor_tokens} tokens in {actor_s:.2f} s, bare {bare_tokens} tokens in {bare_s:.2f} s "
          f"({_window(s0, s1)}, both sides)")
    if bare_tokens != actor_tokens:
        print(f"bench actor: replay generated {bare_tokens} tokens, the actor {actor_tokens} (batch effects on sampling)")
    ratios = [a / b for a, b in rounds]
    print("bench actor: per-round ratios " + " ".join(f"{x:.3f}" for x in ratios)
          + f"; totals {actor_tokens / actor_s:.0f} vs {bare_tokens / bare_s:.0f} tok/s")
    mid_a, mid_b = sorted(rounds, key=lambda ab: ab[0] / ab[1])[len(rounds) // 2]
    if not vllm:
        return [
            result("actor_tokens_per_s", mid_a, "tok/s", "bare engine replaying the same per-episode request chains at the same batch size",
                   mid_b, target=0.9),
        ]
    swap_s, copy_s = sorted(swaps)[len(swaps) // 2]
    print("bench actor: weight swaps " + " ".join(f"{a:.3f}s" for a, _ in swaps) + f" (memory copy of the state {copy_s * 1e3:.1f} ms)")
    return [
        result("actor_vllm_tokens_per_s", mid_a, "tok/s", "bare vLLM (add_request/step loop) replaying the same per-episode request chains",
               mid_b, target=0.9),
        result("vllm_weight_swap_s", swap_s, "s", "memory copy of the same state", copy_s, lower_is_better=True),
    ]


def bare_vllm(engine, chains, batch: int) -> int:
    """Replay per-episode request chains straight through vLLM (``engine.core``) from this
    thread: up to ``batch`` chains at once, each turn added when the previous one finished.
    The engine must be idle (its thread then never touches vLLM).  Returns tokens generated."""
    from turnscale.actors.vllm_engine import cache_salt, sampling_kwargs

    api, core = engine.api, engine.core
    queue = list(reversed(chains))
    active: dict[str, tuple[list, int]] = {}
    count = n = 0

    def add(chain, i):
        nonlocal n
        n += 1
        req, rid = chain[i], f"bare-{n}"
        params = api.SamplingParams(output_kind=api.RequestOutputKind.DELTA, **sampling_kwargs(req))
        core.add_request(rid, api.TokensPrompt(prompt_token_ids=[int(t) for t in req.prompt_ids], cache_salt=cache_salt(engine.weight_loads, engine.version)), params)
        active[rid] = (chain, i)

    while queue and len(active) < batch:
        add(queue.pop(), 0)
    while active:
        for out in core.step():
            count += len(out.outputs[0].token_ids)
            if out.finished:
                chain, i = active.pop(out.request_id)
                if i + 1 < len(chain):
                    add(chain, i + 1)
                elif queue:
                    add(queue.pop(), 0)
    return count


def swap_times(engine, model_path: str, n: int) -> list[tuple[float, float]]:
    """``n`` x (seconds from ``load_weights`` of the full state until the engine reports the
    new version, seconds to copy the same tensors in memory)."""
    import torch

    from turnscale.actors.vllm_state import checkpoint_files, iter_state

    state = {k: v.clone() for k, v in iter_state(checkpoint_files(model_path))}
    out = []
    for _ in range(max(1, n)):
        t = time.perf_counter()
        copy = {k: torch.empty_like(v).copy_(v) for k, v in state.items()}
        copy_s = time.perf_counter() - t
        del copy
        version = engine.version + 1
        errors = engine.stats()["weight_load_errors"]
        t = time.perf_counter()
        engine.load_weights(version, state)
        deadline = t + 300
        while engine.version != version:
            if engine.stats()["weight_load_errors"] > errors or time.perf_counter() > deadline:
                raise RuntimeError(f"bench actor: weight swap failed: {engine.last_weight_error or 'timeout'}")
            time.sleep(0.001)
        out.append((time.perf_counter() - t, copy_s))
    return out


def _window(a: dict, b: dict) -> str:
    steps = b["decode_steps"] - a["decode_steps"]
    occ = (b["batch_occupancy"] * b["decode_steps"] - a["batch_occupancy"] * a["decode_steps"]) / max(steps, 1)
    return f"{steps:.0f} decode steps, mean batch occupancy {occ:.2f}, {b['mid_batch_joins'] - a['mid_batch_joins']:.0f} mid-batch joins"
