"""vLLM engine: pure conversion logic and the engine loop over a fake vLLM (no vLLM here);
the real thing is marked gpu."""

from __future__ import annotations

import types

import numpy as np
import pytest
import trio

from actors.engine import EngineError, GenerateRequest
from actors.vllm_engine import (
    VLLMEngine,
    check_logprob_convention,
    finish_reason,
    load_weights_in_worker,
    sampled_logprobs,
    sampling_kwargs,
    vllm_weight_items,
)
from conf.schema import EngineConfig
from protocol.messages import SamplingParams


def test_sampling_kwargs_ask_for_the_sampled_token_logprob_and_exact_stops():
    req = GenerateRequest([1, 2, 3], SamplingParams(temperature=0.7, max_new_tokens=9), stop_token_ids=(5, 6), seed=4)
    kw = sampling_kwargs(req)
    assert kw["logprobs"] == 0 and kw["temperature"] == 0.7 and kw["max_tokens"] == 9
    assert kw["stop_token_ids"] == [5, 6] and kw["ignore_eos"] is True and kw["seed"] == 4
    assert kw["top_k"] == -1 and kw["top_p"] == 1.0 and kw["n"] == 1


@pytest.mark.parametrize("sp", [SamplingParams(top_k=50), SamplingParams(top_p=0.9)])
def test_truncated_sampling_is_refused_because_vllm_logprobs_would_differ(sp):
    with pytest.raises(EngineError, match="top_k=0 and sampling.top_p=1"):
        check_logprob_convention(sp)
    check_logprob_convention(SamplingParams(temperature=0.3))  # any temperature is fine
    with pytest.raises(EngineError):
        check_logprob_convention(SamplingParams(temperature=0.3), "raw_logprobs")


def test_finish_reasons_and_logprob_extraction():
    assert [finish_reason(r) for r in ("stop", "length", "abort", None)] == ["stop", "length", "aborted", "aborted"]
    with pytest.raises(EngineError):
        finish_reason("weird")
    lp = types.SimpleNamespace
    assert sampled_logprobs([7, 9], [{7: lp(logprob=-0.5)}, {9: lp(logprob=-1.25), 3: lp(logprob=-0.1)}]) == [-0.5, -1.25]
    with pytest.raises(EngineError):
        sampled_logprobs([7], None)
    with pytest.raises(EngineError):
        sampled_logprobs([7, 8], [{7: lp(logprob=-0.5)}])


def test_weight_names_are_hf_names_without_wrappers():
    t = object()
    items = vllm_weight_items(
        {"module.model.layers.0.mlp.up_proj.weight": t, "_orig_mod.lm_head.weight": t,
         "model.layers.0.self_attn.rotary_emb.inv_freq": t, "model.embed_tokens.weight": t},
        tie_word_embeddings=True)
    assert [n for n, _ in items] == ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"]
    items = vllm_weight_items({"lm_head.weight": t}, tie_word_embeddings=False)
    assert [n for n, _ in items] == ["lm_head.weight"]
    with pytest.raises(EngineError, match="same vLLM name"):
        vllm_weight_items({"module.a.w": t, "a.w": t}, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- fake vLLM


class FakeCore:
    """Emits one token per step per request: id = 100 + position, logprob -0.1 * id (DELTA outputs)."""

    def __init__(self):
        self.reqs, self.aborted = {}, []
        self.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(tie_word_embeddings=False))

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = (prompt["prompt_token_ids"], params, 0)

    def abort_request(self, ids):
        for rid in ids:
            self.reqs.pop(rid, None)
            self.aborted.append(rid)

    def step(self):
        outs = []
        for rid, (prompt, params, n) in list(self.reqs.items()):
            tok = 100 + n
            stop = tok in params["stop_token_ids"]
            finished = stop or n + 1 >= params["max_tokens"]
            lp = {tok: types.SimpleNamespace(logprob=-0.1 * tok)}
            comp = types.SimpleNamespace(token_ids=[tok], logprobs=[lp], finish_reason=("stop" if stop else "length") if finished else None)
            outs.append(types.SimpleNamespace(request_id=rid, outputs=[comp], finished=finished))
            if finished:
                del self.reqs[rid]
            else:
                self.reqs[rid] = (prompt, params, n + 1)
        return outs


class FakeLLM:
    def __init__(self):
        self.llm_engine = FakeCore()
        self.loaded, self.prefix_resets = [], 0
        self.worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=self))

    def load_weights(self, weights):
        got = list(weights)
        self.loaded.append(got)
        return {n for n, _ in got}

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self):
        self.prefix_resets += 1
        return True


FAKE_API = types.SimpleNamespace(
    SamplingParams=lambda **kw: kw,
    TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids},
    RequestOutputKind=types.SimpleNamespace(DELTA="delta"),
)


def test_engine_loop_over_fake_vllm_streams_deltas_stops_and_swaps_weights():
    llm = FakeLLM()
    eng = VLLMEngine(EngineConfig(name="vllm", max_batch=4), "unused", llm=llm, vllm_api=FAKE_API)
    out = {}

    async def main():
        async def one(k, n, stops):
            out[k] = await eng.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=n), stop_token_ids=stops, seed=k))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, 5, ())
            nursery.start_soon(one, 1, 50, (103,))
            nursery.start_soon(one, 2, 3, ())
        eng.load_weights(2, {"module.lm_head.weight": "W"})
        await one(3, 2, ())
        with trio.move_on_after(0.05):
            await eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=10**9)))
        with trio.fail_after(10):
            while not llm.llm_engine.aborted:  # the engine thread aborts it in vLLM at its next step
                await trio.sleep(0.005)

    try:
        trio.run(main)
        assert out[0].token_ids.tolist() == [100, 101, 102, 103, 104] and out[0].finish_reason == "length"
        assert out[1].token_ids.tolist() == [100, 101, 102, 103] and out[1].finish_reason == "stop"
        assert np.allclose(out[1].logprobs, [-10.0, -10.1, -10.2, -10.3])
        assert out[2].policy_version == 0 and out[3].policy_version == 2 and eng.version == 2
        assert llm.loaded == [[("lm_head.weight", "W")]] and llm.prefix_resets == 1
        assert eng.stats()["active"] == 0
        with pytest.raises(EngineError, match="truncation"):
            trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(top_k=5))))
    finally:
        eng.close()


def test_load_weights_in_worker_calls_the_models_loader():
    llm = FakeLLM()
    assert load_weights_in_worker(llm.worker, [("a", 1), ("b", 2)]) == 2
    assert llm.loaded == [[("a", 1), ("b", 2)]]


@pytest.mark.gpu
def test_real_vllm_logprobs_match_a_teacher_forced_forward(tiny_model_dir):
    pytest.importorskip("vllm")
    import torch
    from transformers import AutoModelForCausalLM

    from turnscale.logprobs import token_logprobs

    eng = VLLMEngine(EngineConfig(name="vllm", device="cuda", dtype="float32", max_batch=8, gpu_memory_utilization=0.3), tiny_model_dir)
    try:
        prompt = list(range(3, 40))
        sp = SamplingParams(temperature=0.8, max_new_tokens=20)
        res = trio.run(lambda: eng.generate(GenerateRequest(prompt, sp, seed=1)))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        full = torch.tensor([prompt + res.token_ids.tolist()])
        with torch.no_grad():
            logits = model(full).logits[0, len(prompt) - 1 : -1]
        ref = token_logprobs(logits, full[0, len(prompt):], sp.temperature).numpy()
        assert np.abs(ref - res.logprobs).max() < 1e-3
    finally:
        eng.close()


def test_failed_weight_swap_keeps_serving_the_old_version():
    llm = FakeLLM()

    def broken(fn, args=()):
        raise RuntimeError("worker says no")

    llm.collective_rpc = broken
    eng = VLLMEngine(EngineConfig(name="vllm", max_batch=2), "unused", llm=llm, vllm_api=FAKE_API)
    try:
        eng.load_weights(7, {"lm_head.weight": "W"})
        res = trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=2))))
        assert res.policy_version == 0 and eng.version == 0
        assert eng.stats()["weight_load_errors"] == 1 and "worker says no" in eng.last_weight_error
    finally:
        eng.close()
