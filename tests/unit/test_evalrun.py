"""evalrun.play_all with a scripted engine and fake env sessions (the real thing: tests/integration/test_eval_run.py)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from turnscale.actors.engine import GenerateResult
from turnscale.common.parsing import parse_action_line
from turnscale.common.renderer import Renderer
from turnscale.protocol.messages import SamplingParams
from tests.conftest import tiny_corpus
from turnscale.evalmetrics import EpisodeResult, report_rows
from turnscale.evalrun import play_all, plan
from turnscale.common.tinymodel import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tiny_corpus(200), 512)


class ScriptedEngine:
    """Answers 'Action: win' when the seed is even, else 'Action: left'; counts requests in flight."""

    def __init__(self, tok):
        self.tok, self.eot = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.in_flight = self.max_in_flight = 0
        self.seeds: list[int] = []

    async def generate(self, req):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.seeds.append(req.seed)
        await trio.sleep(0.001)
        self.in_flight -= 1
        text = "Thought: go\nAction: win" if req.seed % 2 == 0 else "Thought: hmm\nAction: left"
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eot]
        return GenerateResult(np.asarray(ids, np.int32), np.full(len(ids), -0.25, np.float32), "stop", 0, 0.001)


class FakeSession:
    def __init__(self):
        self.resets = 0

    async def reset(self, data_idx):
        self.resets += 1
        return f"Your goal: task {data_idx}", {"category": f"level{data_idx % 2}"}

    async def step(self, action):
        win = action == "win"
        return ("you won" if win else "nothing happens"), (0.9 if win else 0.0), win, {"success": win}


class FakePool:
    def __init__(self):
        self.sessions: list[FakeSession] = []
        self.closed = False

    async def open(self):
        self.sessions.append(FakeSession())
        return self.sessions[-1]

    async def aclose(self):
        self.closed = True


def run(tok, jobs, concurrency=3, checkpoint="A"):
    engine, pool, seen = ScriptedEngine(tok), FakePool(), []
    recs = trio.run(lambda: play_all(engine=engine, renderer=Renderer.for_tokenizer(tok), parser=parse_action_line,
                                     prompt="Play.", sampling=SamplingParams(max_new_tokens=16, max_context_tokens=1024),
                                     pool=pool, checkpoint=checkpoint, env="babyai", split="test", jobs=jobs,
                                     concurrency=concurrency, on_record=seen.append))
    return recs, engine, pool, seen


def test_every_job_becomes_a_record_in_job_order_with_concurrency_capped(tok):
    jobs = plan([3, 4, 7], samples=4, turn_limits=[2, 5])
    recs, engine, pool, seen = run(tok, jobs)
    assert [(r["turn_limit"], r["data_idx"], r["sample"]) for r in recs] == jobs
    assert len(seen) == len(jobs)
    assert engine.max_in_flight <= 3 and len(pool.sessions) <= 3
    assert sum(s.resets for s in pool.sessions) == len(jobs)  # sessions are reused across episodes
    r = recs[0]
    assert r["checkpoint"] == "A" and r["env"] == "babyai" and r["category"] == "level1" and r["task_id"] == "babyai_3"
    assert r["turns"] and r["turns"][0]["logprob_mean"] == pytest.approx(-0.25) and "Your goal: task 3" in r["prompt"]
    for r in recs:
        assert r["success"] == (r["finish_reason"] == "done") == (r["turns"][-1]["action"] == "win")
        assert r["success"] or (r["num_turns"] == r["turn_limit"] and r["finish_reason"] == "turn_limit")
    rows = report_rows([EpisodeResult.from_record(r) for r in recs], [1, 4])
    assert {r.turn_limit for r in rows} == {2, 5}


def test_same_task_and_sample_get_the_same_seed_under_every_checkpoint_and_limit(tok):
    a, ea, _, _ = run(tok, plan([1, 2], samples=3, turn_limits=[1]), checkpoint="A")
    b, eb, _, _ = run(tok, plan([1, 2], samples=3, turn_limits=[1]), checkpoint="B")
    _, ec, _, _ = run(tok, plan([1, 2], samples=3, turn_limits=[4]), checkpoint="C")
    assert sorted(ea.seeds) == sorted(eb.seeds) and len(set(ea.seeds)) == 6
    assert set(ea.seeds) <= set(ec.seeds)  # the first turn of each episode is drawn alike under any limit
    assert [r["success"] for r in a] == [r["success"] for r in b]
