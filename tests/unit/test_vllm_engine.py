"""vLLM engine: pure logic, the state files, and the engine loop and swap protocol over a
fake vLLM.  The real vLLM (CPU build) is exercised in ``tests/vllm`` (its own venv)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import trio

from turnscale.actors.engine import EngineBroken, EngineError, GenerateRequest
from turnscale.actors.vllm_engine import VLLMEngine, cache_salt, check_logprob_convention, finish_reason, platform_settings, sampled_logprobs, sampling_kwargs
from turnscale.actors.vllm_state import StateStore, check_full_state, iter_state, read_header, vllm_names, write_state
from turnscale.actors.vllm_worker import TurnscaleWorkerExtension
from turnscale.conf.schema import EngineConfig, VLLMEngineConfig
from turnscale.protocol.messages import SamplingParams


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
    names = vllm_names(
        {"module.model.layers.0.mlp.up_proj.weight": t, "_orig_mod.lm_head.weight": t,
         "model.layers.0.self_attn.rotary_emb.inv_freq": t, "model.embed_tokens.weight": t},
        tie_word_embeddings=True)
    assert names == {"model.layers.0.mlp.up_proj.weight": "module.model.layers.0.mlp.up_proj.weight",
                     "model.embed_tokens.weight": "model.embed_tokens.weight"}
    assert list(vllm_names({"lm_head.weight": t}, tie_word_embeddings=False)) == ["lm_head.weight"]
    with pytest.raises(EngineError, match="same vLLM name"):
        vllm_names({"module.a.w": t, "a.w": t}, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- state files

import os  # noqa: E402

import torch  # noqa: E402

EXPECTED = {"model.embed_tokens.weight": (6, 4), "model.norm.weight": (4,), "lm_head.weight": (6, 4)}


def _state(scale: float, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Views of ONE buffer, as the actor's weight receive buffer hands them over."""
    buf = torch.arange(52, dtype=dtype) * scale
    return {"model.embed_tokens.weight": buf[:24].view(6, 4), "model.norm.weight": buf[24:28], "lm_head.weight": buf[28:52].view(6, 4)}


def test_only_the_full_state_with_the_models_shapes_and_float_dtypes_is_accepted():
    check_full_state(_state(1.0), EXPECTED, tie_word_embeddings=False)
    partial = {k: v for k, v in _state(1.0).items() if k != "model.norm.weight"}
    with pytest.raises(EngineError, match=r"full state \(3 tensors\); missing \['model.norm.weight'\]"):
        check_full_state(partial, EXPECTED, tie_word_embeddings=False)
    with pytest.raises(EngineError, match=r"unknown \['extra.weight'\]"):
        check_full_state({**_state(1.0), "extra.weight": torch.zeros(1)}, EXPECTED, tie_word_embeddings=False)
    with pytest.raises(EngineError, match=r"model.norm.weight has shape \(5,\), the model needs \(4,\)"):
        check_full_state({**_state(1.0), "model.norm.weight": torch.zeros(5)}, EXPECTED, tie_word_embeddings=False)
    with pytest.raises(EngineError, match="dtype int64"):
        check_full_state({**_state(1.0), "model.norm.weight": torch.zeros(4, dtype=torch.int64)}, EXPECTED, tie_word_embeddings=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_file_holds_a_copy_of_tensors_that_share_one_buffer(tmp_path, dtype):
    src = _state(0.5, dtype)
    names = check_full_state(src, EXPECTED, tie_word_embeddings=False)
    path = str(tmp_path / "s.safetensors")
    write_state(path, src, names)
    for t in src.values():
        t.fill_(-1)  # the actor reuses its buffer for the next pull
    got = dict(iter_state([path]))
    want = _state(0.5, dtype)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert read_header(path)["model.norm.weight"] == ({torch.float32: "F32", torch.bfloat16: "BF16"}[dtype], (4,))
    assert not (tmp_path / "s.safetensors.tmp").exists()


def test_platform_settings_are_eager_with_a_kv_cache_on_cpu_and_memory_fraction_on_gpus(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpu = platform_settings(EngineConfig(name="vllm", device="cpu", vllm=VLLMEngineConfig(multiprocess=False, kv_cache_gib=2)))
    assert cpu.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                       "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert cpu.llm_kwargs == {"enforce_eager": True}
    gpu = platform_settings(EngineConfig(name="vllm", device="cuda", gpu_memory_utilization=0.5, vllm=VLLMEngineConfig(max_model_len=512)))
    assert gpu.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env
    assert gpu.llm_kwargs == {"gpu_memory_utilization": 0.5, "enforce_eager": False, "max_model_len": 512}
    assert platform_settings(EngineConfig(name="vllm", device="npu")).llm_kwargs["gpu_memory_utilization"] == 0.85
    with pytest.raises(EngineError, match="cpu, cuda or npu"):
        platform_settings(EngineConfig(name="vllm", device="mps"))


def test_state_store_keeps_one_restore_source_and_never_deletes_the_model_folder(tmp_path):
    model_file = tmp_path / "model.safetensors"
    model_file.write_bytes(b"x")
    store = StateStore([str(model_file)], str(tmp_path))
    src = _state(1.0)
    names = check_full_state(src, EXPECTED, tie_word_embeddings=False)
    a = store.write(src, names)
    store.commit(a)
    assert store.restore == a and model_file.exists()
    b = store.write(src, names)
    store.commit(b)
    assert store.restore == b and not os.path.exists(a[0])
    c = store.write(src, names)
    store.discard(c)
    assert not os.path.exists(c[0]) and os.path.exists(b[0])
    store.close()
    assert not os.path.exists(store.dir) and model_file.exists()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux-only")
def test_default_state_files_are_in_memory_files_freed_on_discard_and_close():
    store = StateStore(["/model/model.safetensors"])
    assert store.dir is None
    src = _state(1.0)
    names = check_full_state(src, EXPECTED, tie_word_embeddings=False)
    a = store.write(src, names)
    assert a[0].startswith(f"/proc/{os.getpid()}/fd/")
    got = dict(iter_state(a))  # what a worker process reads through the engine's /proc path
    assert all(torch.equal(got[k], v) for k, v in _state(1.0).items())
    store.commit(a)
    b = store.write(src, names)
    store.commit(b)
    assert not os.path.exists(a[0]) and os.path.exists(b[0])  # the previous state's memory is freed
    c = store.write(src, names)
    store.discard(c)
    assert not os.path.exists(c[0])
    store.close()
    assert not os.path.exists(b[0]) and store.restore == b


# ----------------------------------------------------------------------------- fake vLLM

import os  # noqa: E402

from safetensors.torch import save_file  # noqa: E402


class FakeCore:
    """Emits one token per step per request: id = 100 + position, logprob -0.1 * id (DELTA outputs)."""

    def __init__(self):
        self.reqs, self.aborted, self.salts = {}, [], []
        self.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(tie_word_embeddings=False))
        self.engine_core = types.SimpleNamespace(shutdown=self.shutdown)
        self.shutdowns = 0

    def shutdown(self):
        self.shutdowns += 1

    def add_request(self, rid, prompt, params):
        self.salts.append(prompt["cache_salt"])
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


class FakeWorker(TurnscaleWorkerExtension):
    """The real worker extension over a fake ``reload_weights`` that writes into a dict
    tensor by tensor (as vLLM's loader does) and can fail half-way."""

    def __init__(self, initial):
        self.model = {k: v.clone() for k, v in initial.items()}
        self.fail_next = 0  # how many of the next reloads fail after writing one tensor
        self.loads = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.loads.append([])
        for name, t in weights_iterator:
            self.model[name] = t.clone()
            self.loads[-1].append(name)
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("worker says no")


class FakeLLM:
    def __init__(self, initial):
        self.llm_engine = FakeCore()
        self.worker = FakeWorker(initial)

    def collective_rpc(self, method, args=()):
        assert isinstance(method, str), "only method names cross to vLLM workers"
        return [getattr(self.worker, method)(*args)]


FAKE_API = types.SimpleNamespace(
    SamplingParams=lambda **kw: kw,
    TokensPrompt=lambda prompt_token_ids, cache_salt: {"prompt_token_ids": prompt_token_ids, "cache_salt": cache_salt},
    RequestOutputKind=types.SimpleNamespace(DELTA="delta"),
)


@pytest.fixture
def fake(tmp_path):
    """(engine, llm) over a model folder holding ``_state(1.0)``."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_file({k: v.clone() for k, v in _state(1.0).items()}, str(model_dir / "model.safetensors"))
    llm = FakeLLM(_state(1.0))
    eng = VLLMEngine(EngineConfig(name="vllm", max_batch=4), str(model_dir), llm=llm, vllm_api=FAKE_API, state_dir=str(tmp_path))
    yield eng, llm
    eng.close()


def test_engine_loop_over_fake_vllm_streams_deltas_stops_and_swaps_weights(fake):
    eng, llm = fake
    out = {}

    async def main():
        async def one(k, n, stops):
            out[k] = await eng.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=n), stop_token_ids=stops, seed=k))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, 5, ())
            nursery.start_soon(one, 1, 50, (103,))
            nursery.start_soon(one, 2, 3, ())
        eng.load_weights(2, {"module." + k: v for k, v in _state(2.0).items()})
        await one(3, 2, ())
        with trio.move_on_after(0.05):
            await eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=10**9)))
        with trio.fail_after(10):
            while not llm.llm_engine.aborted:  # the engine thread aborts it in vLLM at its next step
                await trio.sleep(0.005)

    trio.run(main)
    assert out[0].token_ids.tolist() == [100, 101, 102, 103, 104] and out[0].finish_reason == "length"
    assert out[1].token_ids.tolist() == [100, 101, 102, 103] and out[1].finish_reason == "stop"
    assert np.allclose(out[1].logprobs, [-10.0, -10.1, -10.2, -10.3])
    assert out[2].policy_version == 0 and out[3].policy_version == 2 and eng.version == 2
    assert all(torch.equal(llm.worker.model[k], v) for k, v in _state(2.0).items())
    assert llm.llm_engine.salts[:4] == ["w0-v0", "w0-v0", "w0-v0", "w1-v2"]  # no prefix-cache sharing across weights
    assert eng.stats()["active"] == 0 and eng.last_swap_s > 0
    with pytest.raises(EngineError, match="truncation"):
        trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(top_k=5))))
    with pytest.raises(EngineError, match="full state"):
        eng.load_weights(3, {"lm_head.weight": torch.zeros(6, 4)})


def test_cache_salt_differs_for_every_weight_state_even_under_one_version():
    assert cache_salt(0, 0) == "w0-v0"
    salts = {cache_salt(loads, version) for loads in range(4) for version in range(4)}
    assert len(salts) == 16


def test_a_resumed_learner_reusing_a_version_number_gets_a_fresh_prefix_cache_salt(fake):
    """A resumed learner (new incarnation) publishes other weights under a version the
    actor already played; KV blocks cached under the old weights must not be reused."""
    eng, llm = fake
    ask = lambda: trio.run(lambda: eng.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=1))))  # noqa: E731

    def swap(version, scale):
        s = eng.load_weights(version, _state(scale))
        trio.run(s.wait)

    swap(3, 2.0)
    ask()
    swap(3, 4.0)  # the resumed learner's version 3: other weights
    ask()
    llm.worker.fail_next = 1  # a failed swap restores version 3's second weights: same salt
    with pytest.raises(EngineError):
        swap(4, 5.0)
    ask()
    first, second, after_failure = llm.llm_engine.salts
    assert first != second and second == after_failure
    assert eng.weight_loads == 2


def test_failed_swap_reloads_the_previous_weights_and_keeps_the_version(fake):
    eng, llm = fake
    eng.load_weights(1, _state(3.0))
    trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1))))
    assert eng.version == 1
    llm.worker.fail_next = 1  # the next swap dies after writing one tensor into the model
    swap = eng.load_weights(2, _state(5.0))

    async def failed():
        with pytest.raises(EngineError, match="previous weights were reloaded"):
            with trio.fail_after(30):
                await swap.wait()

    trio.run(failed)
    assert swap.outcome == swap.FAILED and not swap.broken
    res = trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=2))))
    assert res.policy_version == 1 and eng.version == 1
    assert eng.stats()["weight_load_errors"] == 1 and "previous weights were reloaded" in eng.last_weight_error
    assert all(torch.equal(llm.worker.model[k], v) for k, v in _state(3.0).items())  # version 1's weights, in full
    assert len(os.listdir(eng._store.dir)) == 1  # the failed state's file is gone, version 1's kept


def test_swap_whose_restore_fails_too_reports_the_engine_broken_and_it_refuses_requests(fake):
    eng, llm = fake
    llm.worker.fail_next = 2  # the swap and the restore both die
    swap = eng.load_weights(1, _state(5.0))

    async def main():
        with pytest.raises(EngineBroken, match="restoring the previous weights failed too"):
            with trio.fail_after(30):
                await swap.wait()
        with pytest.raises(EngineBroken):
            await eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1)))

    trio.run(main)
    assert eng.version == 0 and eng.stats()["engine_broken"] == 1.0


def test_close_shuts_vllm_down_once_and_removes_the_state_files(fake):
    eng, llm = fake
    eng.load_weights(1, _state(3.0))
    trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1))))
    d = eng._store.dir
    eng.close()
    eng.close()
    assert llm.llm_engine.shutdowns == 1 and not os.path.exists(d)


def test_a_model_without_safetensors_is_refused_at_once(tmp_path):
    with pytest.raises(EngineError, match="needs the model as safetensors"):
        VLLMEngine(EngineConfig(name="vllm"), str(tmp_path), llm=FakeLLM({}), vllm_api=FAKE_API)


def test_tied_embeddings_come_from_the_model_folder_and_drop_lm_head_from_swaps(tmp_path):
    import json

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    tied = {k: v.clone() for k, v in _state(1.0).items() if k != "lm_head.weight"}
    save_file(tied, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    llm = FakeLLM(tied)
    eng = VLLMEngine(EngineConfig(name="vllm", max_batch=2), str(model_dir), llm=llm, vllm_api=FAKE_API, state_dir=str(tmp_path))
    try:
        assert eng.tie_word_embeddings
        eng.load_weights(1, _state(2.0))  # the learner's state dict still names lm_head.weight
        trio.run(lambda: eng.generate(GenerateRequest([1], SamplingParams(max_new_tokens=1))))
        assert eng.version == 1 and sorted(llm.worker.loads[-1]) == sorted(tied)
    finally:
        eng.close()
