"""The hf engine: continuous batching with exact behaviour log-probs, sampling, aborts, weight swaps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from turnscale.actors.engine import EngineClosed, EngineError, GenerateRequest
from turnscale.actors.hf_engine import HFEngine, sample_tokens
from turnscale.conf.schema import EngineConfig
from turnscale.protocol.messages import SamplingParams
from turnscale.common.logprobs import token_logprobs


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    eng = HFEngine(EngineConfig(max_batch=8), tiny_model_dir)
    yield eng
    eng.close()


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, size=int(k)).tolist() for k in rng.integers(2, 40, size=n)]


def teacher_forced(model, prompt, out, temperature):
    full = torch.tensor([list(prompt) + out.tolist()])
    with torch.no_grad():
        logits = model(full).logits[0]
    return logits[len(prompt) - 1 : -1], token_logprobs(logits[len(prompt) - 1 : -1], full[0, len(prompt):], temperature)


async def wait_for(pred, timeout=20.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.002)


def test_logprobs_equal_teacher_forced_forward_for_mixed_batch_with_mid_batch_joins(engine):
    ps = prompts(7)
    params = [
        SamplingParams(top_k=1, max_new_tokens=40),  # greedy
        SamplingParams(temperature=1.0, max_new_tokens=25),
        SamplingParams(temperature=0.7, max_new_tokens=33),
        SamplingParams(temperature=1.3, top_k=20, max_new_tokens=17),
        SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=30),
        SamplingParams(top_k=1, max_new_tokens=12),
        SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=21),
    ]
    results = [None] * len(ps)
    joins_before = engine.stats()["mid_batch_joins"]

    async def one(i):
        results[i] = await engine.generate(GenerateRequest(ps[i], params[i], seed=100 + i))

    async def main():
        async with trio.open_nursery() as n:
            for i in range(3):  # a first batch...
                n.start_soon(one, i)
            steps = engine.stats()["decode_steps"]
            await wait_for(lambda: engine.stats()["decode_steps"] >= steps + 3)
            for i in range(3, 7):  # ...joined mid-generation by the rest
                n.start_soon(one, i)
                await trio.sleep(0.003)

    trio.run(main)
    assert engine.stats()["mid_batch_joins"] > joins_before
    for i, (p, sp, r) in enumerate(zip(ps, params, results)):
        assert r.finish_reason == "length" and len(r.token_ids) == sp.max_new_tokens
        assert r.token_ids.dtype == np.int32 and r.logprobs.dtype == np.float32
        logits, ref = teacher_forced(engine.model, p, r.token_ids, sp.temperature)
        assert np.abs(ref.numpy() - r.logprobs).max() < 1e-4, i
        if sp.top_k == 1:
            assert (logits.argmax(-1).numpy() == r.token_ids).all()


def test_same_seed_gives_same_tokens_alone_or_in_a_batch(engine):
    p = prompts(1, seed=3)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=20)

    async def alone():
        return await engine.generate(GenerateRequest(p, sp, seed=7))

    async def crowded():
        out = {}

        async def one(k, prompt, seed):
            out[k] = await engine.generate(GenerateRequest(prompt, sp, seed=seed))

        async with trio.open_nursery() as n:
            for k, q in enumerate(prompts(5, seed=9)):
                n.start_soon(one, k, q, k)
            n.start_soon(one, "x", p, 7)
        return out["x"]

    a, b = trio.run(alone), trio.run(crowded)
    assert a.token_ids.tolist() == b.token_ids.tolist()
    c = trio.run(lambda: engine.generate(GenerateRequest(p, sp, seed=8)))
    assert c.token_ids.tolist() != a.token_ids.tolist()


def test_stop_token_ends_generation_and_is_included(engine):
    p = prompts(1, seed=4)[0]
    greedy = SamplingParams(top_k=1, max_new_tokens=30)
    free = trio.run(lambda: engine.generate(GenerateRequest(p, greedy)))
    stop = int(free.token_ids[5])
    first = free.token_ids.tolist().index(stop)
    got = trio.run(lambda: engine.generate(GenerateRequest(p, greedy, stop_token_ids=(stop,))))
    assert got.finish_reason == "stop" and got.token_ids.tolist() == free.token_ids.tolist()[: first + 1]


def test_cancelled_request_leaves_the_batch(engine):
    p = prompts(1, seed=5)[0]

    async def main():
        with trio.move_on_after(0.05):
            await engine.generate(GenerateRequest(p, SamplingParams(max_new_tokens=3000)))
        await wait_for(lambda: engine.stats()["active"] == 0, timeout=5)

    trio.run(main)


def test_sample_tokens_truncates_but_reports_full_vocab_logprob():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 200)
    u = torch.rand(200, dtype=torch.float64).clamp_(min=1e-9)
    temp = torch.full((200,), 0.5)
    ids, lps = sample_tokens(logits, temp, torch.full((200,), 2), torch.ones(200), u)
    assert set(ids.tolist()) <= {0, 1} and len(set(ids.tolist())) == 2
    full = torch.log_softmax(logits / 0.5, -1)
    assert torch.allclose(lps, full.gather(-1, ids[:, None])[:, 0])
    ids, _ = sample_tokens(logits, temp, torch.zeros(200, dtype=torch.long), torch.full((200,), 0.1), u)
    assert set(ids.tolist()) == {0}
    ids, _ = sample_tokens(logits, torch.ones(200), torch.zeros(200, dtype=torch.long), torch.ones(200), u)
    assert set(ids.tolist()) == {0, 1, 2, 3}


def perturbed(model, scale):
    return {"lm_head.weight": model.state_dict()["lm_head.weight"].clone() * scale}


@pytest.mark.parametrize("mode", ["between_turns", "inflight"])
def test_weight_swap_safe_points_and_versions(tiny_model_dir, mode):
    eng = HFEngine(EngineConfig(max_batch=4, update_mode=mode), tiny_model_dir)
    p = prompts(2, seed=6)
    sp = SamplingParams(top_k=1, max_new_tokens=60)
    out = {}

    async def one(k, prompt):
        out[k] = await eng.generate(GenerateRequest(prompt, sp))

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(one, "a", p[0])
            await wait_for(lambda: eng.stats()["decode_steps"] >= 5)
            eng.load_weights(1, perturbed(eng.model, -1.0))
            await trio.sleep(0.01)
            n.start_soon(one, "b", p[1])

    try:
        trio.run(main)
        a, b = out["a"], out["b"]
        assert eng.version == 1 and b.policy_version == 1 and (b.versions() == 1).all()
        if mode == "between_turns":
            assert a.policy_version == 0 and (a.versions() == 0).all()
        else:
            v = a.versions()
            assert a.policy_version == 0 and v[0] == 0 and v[-1] == 1 and (np.diff(v) >= 0).all()
        # b was sampled by the new weights: its log-probs match a teacher-forced pass of them
        _, ref = teacher_forced(eng.model, p[1], b.token_ids, 1.0)
        assert np.abs(ref.numpy() - b.logprobs).max() < 1e-4
    finally:
        eng.close()


def test_bad_weights_raise_at_once(engine):
    with pytest.raises(EngineError, match="unknown parameter"):
        engine.load_weights(5, {"nope.weight": torch.zeros(2)})
    with pytest.raises(EngineError, match="shape"):
        engine.load_weights(5, {"lm_head.weight": torch.zeros(2, 2)})
    assert engine.version == 0


def test_close_aborts_running_requests_and_refuses_new_ones(tiny_model_dir):
    eng = HFEngine(EngineConfig(max_batch=2), tiny_model_dir)
    p = prompts(3, seed=8)
    out = []

    async def one(prompt):
        out.append(await eng.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=3000))))

    async def main():
        async with trio.open_nursery() as n:
            for q in p:
                n.start_soon(one, q)
            await wait_for(lambda: eng.stats()["decode_steps"] >= 3)
            await trio.to_thread.run_sync(eng.close)

    trio.run(main)
    assert sorted(r.finish_reason for r in out) == ["aborted"] * 3
    assert max(len(r.token_ids) for r in out) > 0  # running ones keep what they sampled
    with pytest.raises(EngineClosed):
        trio.run(lambda: eng.generate(GenerateRequest(p[0], SamplingParams())))
    with pytest.raises(EngineError, match="empty prompt"):
        trio.run(lambda: eng.generate(GenerateRequest([], SamplingParams())))


def test_joiner_finishing_on_its_first_token_leaves_the_others_running(engine):
    ps = prompts(4, seed=12)
    out = {}

    async def one(k, prompt, n):
        out[k] = await engine.generate(GenerateRequest(prompt, SamplingParams(top_k=1, max_new_tokens=n)))

    async def main():
        with trio.fail_after(60):  # the bug this guards against lost requests (a hang)
            await play()

    async def play():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "long0", ps[0], 30)
            nursery.start_soon(one, "long1", ps[1], 30)
            await wait_for(lambda: engine.stats()["decode_steps"] >= 3)
            for k in range(6):  # one-token joiners, alone and together, mid-batch
                nursery.start_soon(one, f"short{k}", ps[2 + k % 2], 1)
                if k % 2:
                    await trio.sleep(0.002)

    trio.run(main)
    assert len(out["long0"].token_ids) == 30 and len(out["long1"].token_ids) == 30
    assert all(len(out[f"short{k}"].token_ids) == 1 for k in range(6))
    _, ref = teacher_forced(engine.model, ps[1], out["long1"].token_ids, 1.0)
    assert np.abs(ref.numpy() - out["long1"].logprobs).max() < 1e-4


def test_next_turn_reuses_the_previous_turns_kv_exactly(tiny_model_dir):
    eng = HFEngine(EngineConfig(max_batch=8), tiny_model_dir)
    cold = HFEngine(EngineConfig(max_batch=8), tiny_model_dir, prefix_cache_tokens=0)
    ps = prompts(3, seed=21)
    sp = SamplingParams(temperature=0.9, max_new_tokens=15)

    async def batch(e, reqs):
        out = [None] * len(reqs)

        async def one(i):
            out[i] = await e.generate(reqs[i])

        async with trio.open_nursery() as n:
            for i in range(len(reqs)):
                n.start_soon(one, i)
        return out

    try:
        first = trio.run(batch, eng, [GenerateRequest(p, sp, seed=i) for i, p in enumerate(ps)])
        # turn 2: each prompt extends turn 1 (prompt + sampled + an observation delta), plus a fresh prompt
        nxt = [p + r.token_ids.tolist() + [5, 6, 7 + i] for i, (p, r) in enumerate(zip(ps, first))] + [prompts(1, seed=22)[0]]
        reqs = [GenerateRequest(q, sp, seed=10 + i) for i, q in enumerate(nxt)]
        before = eng.stats()["prefix_reused_tokens"]
        warm = trio.run(batch, eng, reqs)
        assert eng.stats()["prefix_reused_tokens"] - before >= sum(len(p) + 14 for p in ps)
        ref = trio.run(batch, cold, reqs)
        assert cold.stats()["prefix_reused_tokens"] == 0
        for q, w, c in zip(nxt, warm, ref):
            assert w.token_ids.tolist() == c.token_ids.tolist()
            _, tf = teacher_forced(eng.model, q, w.token_ids, sp.temperature)
            assert np.abs(tf.numpy() - w.logprobs).max() < 1e-4
        # a weight swap empties the cache: nothing computed by old weights seeds a new request
        eng.load_weights(1, perturbed(eng.model, 1.0))
        trio.run(batch, eng, [GenerateRequest([1, 2], SamplingParams(max_new_tokens=1))])
        assert eng.stats()["prefix_cache_entries"] <= 1
        reused = eng.stats()["prefix_reused_tokens"]
        trio.run(batch, eng, [GenerateRequest(nxt[0] + warm[0].token_ids.tolist() + [9], sp)])
        assert eng.stats()["prefix_reused_tokens"] == reused
    finally:
        eng.close()
        cold.close()


def test_weight_check_passes_an_engine_that_stores_weights_in_another_dtype_and_catches_real_damage(tiny_model_dir):
    """An engine in bfloat16 fed float32 transfer bytes holds the rounded values: the check
    after a swap (``actor.verify_weights``) must compare like with like — the pulled bytes as
    the engine stores them — or every version reads as torn and the actor re-pulls forever.
    A weight that really differs is still caught."""
    from turnscale.actors.engine import mismatched_weights

    eng = HFEngine(EngineConfig(max_batch=2, dtype="bfloat16"), tiny_model_dir)
    try:
        pulled = {n: (t.detach().float() * 1.001).contiguous() for n, t in eng.model.state_dict().items()
                  if t.is_floating_point()}  # float32 bytes, not representable in bf16

        async def main():
            with trio.fail_after(60):
                await eng.load_weights(1, pulled).wait()

        trio.run(main)
        assert mismatched_weights(eng, pulled, "float32", "crc32c") == []
        name = next(iter(pulled))
        with torch.no_grad():
            eng.model.state_dict()[name].add_(1.0)  # damage after the swap
        assert mismatched_weights(eng, pulled, "float32", "crc32c") == [name]
    finally:
        eng.close()
