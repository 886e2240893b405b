"""``turnscale bench actor``: actor overhead against the bare engine, in one run.

System: ``run_group`` (renderer with template checks, parser, episode bookkeeping, trio
bridge) plays ``--actor-rounds`` rounds of ``--actor-batch / --actor-group`` concurrent
groups against an instant in-process env, on the ``hf`` engine with the tiny model.
Every ``GenerateRequest`` it sends is recorded.

Baseline: after each actor round, the same engine replays exactly that round's requests (same prompts, sampling
parameters and seeds, hence the same tokens) from ``--actor-batch`` workers pulling
from one queue, so the batch stays as full as the batch size allows and no per-turn
work happens between requests.

Figure: generated tokens/s of the actor over the baseline's (target >= 0.9).
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import Result, result


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--actor-batch", type=int, default=16, help="engine max batch = concurrent episodes")
    parser.add_argument("--actor-group", type=int, default=8, help="episodes per group")
    parser.add_argument("--actor-rounds", type=int, default=6, help="rounds of concurrent groups")
    parser.add_argument("--actor-turns", type=int, default=4, help="turns per episode")
    parser.add_argument("--actor-new-tokens", type=int, default=24, help="max new tokens per turn")
    parser.add_argument("--actor-model", default="tiny", help="model path, or 'tiny' (built once, cached)")


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
    """Engine proxy that records every request (and counts generated tokens)."""

    def __init__(self, engine) -> None:
        self.engine, self.requests, self.tokens = engine, [], 0

    async def generate(self, req):
        self.requests.append(req)
        res = await self.engine.generate(req)
        self.tokens += len(res.token_ids)
        return res

    def __getattr__(self, name):
        return getattr(self.engine, name)


def corpus():
    from actors.parsing import ACTION_LINE_HINT, BACKTICKS_HINT, TAGS_HINT
    from actors.prompts import INSTRUCTIONS
    from actors.sim_engine import RESPONSES

    import random

    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    base = list(INSTRUCTIONS.values()) + list(RESPONSES) + [ACTION_LINE_HINT, TAGS_HINT, BACKTICKS_HINT]
    words = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(9)) for _ in range(1500)]
    return [f"{t} {i}" for i in range(20) for t in base] + words


def run(args: argparse.Namespace) -> list[Result]:
    import torch
    import trio
    from transformers import AutoTokenizer

    from actors.engine import make_engine
    from actors.episode import run_group
    from actors.parsing import parse_action_line
    from actors.prompts import instruction
    from actors.renderer import Renderer
    from conf.schema import EngineConfig, ModelConfig
    from protocol.messages import Lease, SamplingParams, Task
    from turnscale.tinymodel import ensure_model

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    path = ensure_model(ModelConfig(path=args.actor_model), corpus)
    tok = AutoTokenizer.from_pretrained(path)
    renderer = Renderer.for_tokenizer(tok)
    engine = make_engine(EngineConfig(name="hf", max_batch=args.actor_batch), path)
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

    async def bare(requests) -> int:
        queue = list(reversed(requests))
        count = 0

        async def worker():
            nonlocal count
            while queue:
                res = await engine.generate(queue.pop())
                count += len(res.token_ids)

        async with trio.open_nursery() as n:
            for _ in range(args.actor_batch):
                n.start_soon(worker)
        return count

    actor_s = bare_s = 0.0
    actor_tokens = bare_tokens = 0
    try:
        trio.run(actor, 0)  # warm-up
        s0 = engine.stats()
        for r in range(1, args.actor_rounds + 1):  # alternate, so load drift on a shared box hits both sides
            rec.requests, rec.tokens = [], 0
            t = time.perf_counter()
            trio.run(actor, r)
            actor_s += time.perf_counter() - t
            actor_tokens += rec.tokens
            t = time.perf_counter()
            bare_tokens += trio.run(bare, rec.requests)
            bare_s += time.perf_counter() - t
        s1 = engine.stats()
    finally:
        engine.close()
    print(f"bench actor: actor {actor_tokens} tokens in {actor_s:.2f} s, bare {bare_tokens} tokens in {bare_s:.2f} s "
          f"({_window(s0, s1)}, both sides)")
    if bare_tokens != actor_tokens:
        print(f"bench actor: replay generated {bare_tokens} tokens, the actor {actor_tokens} (batch effects on sampling)")
    return [
        result("actor_tokens_per_s", actor_tokens / actor_s, "tok/s", "bare engine replaying the same requests at the same batch size",
               bare_tokens / bare_s, target=0.9),
    ]


def _window(a: dict, b: dict) -> str:
    steps = b["decode_steps"] - a["decode_steps"]
    occ = (b["batch_occupancy"] * b["decode_steps"] - a["batch_occupancy"] * a["decode_steps"]) / max(steps, 1)
    return f"{steps:.0f} decode steps, mean batch occupancy {occ:.2f}, {b['mid_batch_joins'] - a['mid_batch_joins']:.0f} mid-batch joins"
