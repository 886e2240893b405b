from __future__ import annotations

import dataclasses

import numpy as np
import trio

from turnscale.actors.engine import GenerateRequest
from turnscale.actors.engines import make_engine
from turnscale.actors.episode import run_episode
from turnscale.common.parsing import parse_action_line
from turnscale.common.renderer import Renderer
from turnscale.actors.sim_engine import SIM_LOGPROB
from turnscale.conf.schema import EngineConfig, SimEngineConfig
from turnscale.protocol.messages import SamplingParams, Task
from tests.conftest import tiny_corpus
from turnscale.common.tinymodel import build_tokenizer


def test_sim_engine_returns_real_tokens_ending_with_the_stop_token():
    tok = build_tokenizer(tiny_corpus(100), 400)
    cfg = EngineConfig(name="sim", max_batch=4, sim=SimEngineConfig(decode_s_per_step=1e-4, prefill_s_per_token=0, mean_new_tokens=8, long_tail=0.25))
    eng = make_engine(cfg, "unused", tokenizer=tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    sp = SamplingParams(max_new_tokens=30)
    by_seed = {}

    async def main():
        async def one(i):
            by_seed[i] = await eng.generate(GenerateRequest([1, 2, 3], sp, stop_token_ids=(eot,), seed=i))

        async with trio.open_nursery() as n:
            for i in range(40):
                n.start_soon(one, i)

    try:
        trio.run(main)
        out = list(by_seed.values())
        reasons = {r.finish_reason for r in out}
        assert reasons == {"stop", "length"}
        for r in out:
            assert 1 <= len(r.token_ids) <= 30 and (r.logprobs == SIM_LOGPROB).all()
            assert (r.token_ids[-1] == eot) == (r.finish_reason == "stop")
            assert r.finish_reason == "stop" or len(r.token_ids) == 30
        assert eng.stats()["tokens_generated"] == sum(len(r.token_ids) for r in out)
        # same seed -> same output
        again = trio.run(lambda: eng.generate(GenerateRequest([9], sp, stop_token_ids=(eot,), seed=3)))
        assert by_seed[3].token_ids.tolist() == again.token_ids.tolist()
        eng.load_weights(4, {})
        r = trio.run(lambda: eng.generate(GenerateRequest([9], sp, stop_token_ids=(eot,), seed=3)))
        assert r.policy_version == 4 and eng.version == 4
    finally:
        eng.close()


def test_sim_engine_plays_episodes_with_parseable_actions():
    tok = build_tokenizer(tiny_corpus(100), 400)
    cfg = EngineConfig(name="sim", sim=SimEngineConfig(decode_s_per_step=1e-4, mean_new_tokens=200, long_tail=0.0))
    eng = make_engine(cfg, "unused", tokenizer=tok)

    class Env:
        async def reset(self, i):
            return "go", {}

        async def step(self, a):
            return "ok", 0.0, False, {}

    try:
        ep = trio.run(lambda: run_episode(engine=eng, renderer=Renderer.for_tokenizer(tok), env=Env(), task=Task(env="babyai", data_idx=0),
                                          turn_limit=6, sampling=SamplingParams(max_new_tokens=64), parser=parse_action_line, prompt="p", seed=0))
    finally:
        eng.close()
    assert ep.finish_reason == "turn_limit" and len(ep.turns) == 6
    assert sum(not t.parse_error for t in ep.turns) >= 1
