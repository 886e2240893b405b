"""run_group with the real hf engine, the tiny model and its tokenizer, and a scripted in-process env.

The learner-side check: a teacher-forced forward pass over each finished episode's whole
token stream reproduces the behaviour log-probs on every sampled token (1e-4), so actor
and learner agree token for token across turns and observation deltas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio
from transformers import AutoTokenizer

from turnscale.actors.engines import make_engine
from turnscale.actors.episode import run_group
from turnscale.common.parsing import ParseResult
from turnscale.common.renderer import Renderer
from turnscale.conf.schema import EngineConfig
from turnscale.protocol import codec
from turnscale.protocol.messages import Lease, SamplingParams, Task
from turnscale.common.logprobs import token_logprobs


class ScriptedEnv:
    """Done after ``n`` steps with reward 1; observations mention digits and the action."""

    def __init__(self, n: int) -> None:
        self.n, self.k = n, 0

    async def reset(self, data_idx: int):
        self.k = 0
        await trio.sleep(0)
        return f"Your goal: reach room {data_idx}. You see a door 3 steps ahead.", {}

    async def step(self, action: str):
        self.k += 1
        await trio.sleep(0)
        done = self.k >= self.n
        return f"step {self.k}: you did {action[:20]!r}", float(done), done, {"success": done}


def anything(text: str) -> ParseResult:
    return ParseResult(ok=True, action=text.strip() or "noop")


def test_group_streams_match_a_teacher_forced_forward_pass(tiny_model_dir):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = Renderer.for_tokenizer(tok)
    engine = make_engine(EngineConfig(name="hf", max_batch=8), tiny_model_dir)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=12, max_context_tokens=400)
    lease = Lease(lease_id="l-1", task=Task(env="babyai", data_idx=4), group_size=4, turn_limit=6, policy_version=0, ttl_s=60, seed=11)
    envs = [ScriptedEnv(n) for n in (2, 3, 4, 9)]

    async def main():
        return await run_group(engine=engine, renderer=renderer, sessions=lambda i: envs[i], lease=lease,
                               actor_id="t", sampling=sampling, parser=anything, prompt="You are an agent.")

    try:
        group = trio.run(main)
    finally:
        engine.close()
    assert not group.failed, group.error
    assert engine.stats()["prefix_reused_tokens"] > 0  # later turns reused earlier turns' KV
    assert [ep.finish_reason for ep in group.episodes] == ["done", "done", "done", "turn_limit"]
    assert [len(ep.turns) for ep in group.episodes] == [2, 3, 4, 6]
    group = codec.decode(codec.encode(group))
    for ep in group.episodes:
        ids = torch.from_numpy(ep.token_ids.astype(np.int64))[None]
        with torch.no_grad():
            logits = engine.model(ids).logits[0]
        lp = token_logprobs(logits[:-1], ids[0, 1:], sampling.temperature).numpy()
        mask = ep.loss_mask[1:].astype(bool)
        assert mask.sum() == sum(t.token_end - t.token_start for t in ep.turns)
        assert np.abs(lp[mask] - ep.logprobs[1:][mask]).max() < 1e-4
        assert (ep.versions[ep.loss_mask == 1] == 0).all()
        # the first prompt is the template's own rendering
        first = renderer.tokenizer.apply_chat_template(
            [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Your goal: reach room 4. You see a door 3 steps ahead."}],
            add_generation_prompt=True, tokenize=False)
        assert ep.token_ids[: ep.prompt_len].tolist() == tok.encode(first, add_special_tokens=False)
        assert ep.reward == (1.0 if ep.finish_reason == "done" else 0.0)
