"""The real vLLM (CPU build) behind turnscale's engine interface: behaviour log-probs equal
the learner's teacher-forced log-probs, weight swaps (mid-run, failed), continuous batching,
aborts, and the multiprocess path's swap and shutdown.  Needs ``.venv-vllm``
(``bash scripts/setup_vllm.sh``); skipped where vLLM is not installed."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import trio  # noqa: E402

from turnscale.actors.engine import GenerateRequest  # noqa: E402
from turnscale.actors.vllm_state import checkpoint_files, iter_state  # noqa: E402
from turnscale.benchmarks.actor import InstantEnv  # noqa: E402 (a never-ending env with fixed observations)
from turnscale.protocol.messages import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 2e-4  # float32 vLLM vs float32 transformers (measured ~1e-6)


# ----------------------------------------------------------------------------- helpers


def model_state(model_dir: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in iter_state(checkpoint_files(model_dir))}


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


class Reference:
    """The learner's teacher-forced log-probs (``learner.logprobs.token_logprobs_BT``) under a
    given state of the model."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(self, state: dict[str, torch.Tensor], ids: list[int], temperature: float) -> np.ndarray:
        from turnscale.learner.logprobs import token_logprobs_BT

        self.model.load_state_dict(state, strict=False)
        x = torch.tensor([ids])
        with torch.no_grad():
            return token_logprobs_BT(self.model(x).logits.float(), x, temperature)[0].numpy()

    def check(self, state, prompt: list[int], res, temperature: float) -> float:
        """Max |vLLM - learner| over ``res``'s sampled tokens."""
        ids = list(prompt) + res.token_ids.tolist()
        ref = self.logprobs(state, ids, temperature)[len(prompt):]
        return float(np.abs(ref - res.logprobs).max())


@pytest.fixture(scope="module")
def reference(tiny_model_dir_hd32):
    return Reference(tiny_model_dir_hd32)


def prompt_ids(i: int, n: int = 24) -> list[int]:
    rng = np.random.default_rng(i)
    return rng.integers(5, 1000, size=n).tolist()


async def wait_for(cond, what: str, timeout_s: float = 120.0) -> None:
    with trio.fail_after(timeout_s):
        while not cond():
            await trio.sleep(0.01)


def swap_and_wait(eng, version: int, state) -> None:
    swap = eng.load_weights(version, state)

    async def wait():
        with trio.fail_after(120):
            await swap.wait()  # raises if the swap failed

    trio.run(wait)
    assert eng.version == version


# ----------------------------------------------------------------------------- in-process engine


def test_behaviour_logprobs_of_multi_turn_episodes_equal_the_learners_teacher_forced_logprobs(inproc_engine, tiny_model_dir_hd32, reference):
    from transformers import AutoTokenizer

    from turnscale.actors.episode import run_episode
    from turnscale.common.parsing import parse_action_line
    from turnscale.common.prompts import instruction
    from turnscale.common.renderer import Renderer
    from turnscale.protocol.messages import Task

    renderer = Renderer.for_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir_hd32))
    sampling = SamplingParams(temperature=0.8, max_new_tokens=16, max_context_tokens=2048)
    episodes = []

    async def main():
        async def one(i):
            episodes.append(await run_episode(engine=inproc_engine, renderer=renderer, env=InstantEnv(), task=Task(env="babyai", data_idx=i),
                                              turn_limit=3, sampling=sampling, parser=parse_action_line, prompt=instruction("babyai"), seed=i))

        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(one, i)

    trio.run(main)
    state = model_state(tiny_model_dir_hd32)
    for ep in episodes:
        assert ep.finish_reason == "turn_limit" and len(ep.turns) == 3, (ep.finish_reason, ep.error)
        mask = ep.loss_mask == 1
        assert mask.sum() > 3 and (ep.versions[mask] == inproc_engine.version).all()
        ref = reference.logprobs(state, ep.token_ids.tolist(), sampling.temperature)
        assert np.abs(ref[mask] - ep.logprobs[mask]).max() < TOL


def test_mid_run_swap_waits_for_running_requests_and_new_requests_use_the_new_weights(inproc_engine, tiny_model_dir_hd32, reference):
    eng = inproc_engine
    v0 = eng.version
    base = model_state(tiny_model_dir_hd32)
    new = perturbed(base, seed=1)
    sent = {k: v.clone() for k, v in new.items()}  # the engine must keep none of `new`
    sp = SamplingParams(temperature=1.0, max_new_tokens=40)
    old_res, new_res = {}, {}

    async def main():
        async def gen(store, i):
            store[i] = await eng.generate(GenerateRequest(prompt_ids(i), sp, seed=i))

        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(gen, old_res, i)
            await wait_for(lambda: eng.stats()["active"] == 3, "three running requests")
            eng.load_weights(v0 + 1, new)  # requested mid-run: applied once those three finish
            for i in range(3, 6):
                n.start_soon(gen, new_res, i)
            await wait_for(lambda: eng.version == v0 + 1, "the swap")
            for t in new.values():
                t.fill_(float("nan"))  # the actor reuses its buffer after the version moved

    try:
        trio.run(main)
        for i, r in old_res.items():
            assert (r.versions() == v0).all() and r.policy_version == v0
            assert reference.check(base, prompt_ids(i), r, 1.0) < TOL
        for i, r in new_res.items():
            assert (r.versions() == v0 + 1).all() and r.policy_version == v0 + 1
            assert reference.check(sent, prompt_ids(i), r, 1.0) < TOL
            assert reference.check(base, prompt_ids(i), r, 1.0) > 10 * TOL  # the weights really changed
    finally:
        swap_and_wait(eng, v0 + 2, base)


def _inproc_worker(eng):
    """The vLLM worker object inside this process (in-process mode only)."""
    return eng.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_a_swap_that_fails_half_way_leaves_the_previous_weights_in_place(inproc_engine, tiny_model_dir_hd32, reference):
    eng = inproc_engine
    v0 = eng.version
    base = model_state(tiny_model_dir_hd32)
    prev = perturbed(base, seed=2)
    swap_and_wait(eng, v0 + 1, prev)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24)
    before = trio.run(lambda: eng.generate(GenerateRequest(prompt_ids(7), sp, seed=7)))

    worker = _inproc_worker(eng)
    real_reload = worker.reload_weights
    calls = []

    def dies_half_way(weights_iterator, is_checkpoint_format=True, **kw):
        calls.append(1)
        if len(calls) > 1:  # the engine's restore goes through untouched
            return real_reload(weights_iterator=weights_iterator, is_checkpoint_format=is_checkpoint_format, **kw)
        items = list(weights_iterator)

        def half():
            yield from items[: len(items) // 2]
            raise RuntimeError("injected: the worker died half-way through the swap")

        return real_reload(weights_iterator=half(), is_checkpoint_format=is_checkpoint_format, **kw)

    worker.reload_weights = dies_half_way
    try:
        swap = eng.load_weights(v0 + 2, perturbed(base, seed=3, scale=0.5))
        trio.run(wait_for, lambda: swap.released, "the failed swap")
    finally:
        del worker.reload_weights
    try:
        assert swap.outcome == swap.FAILED and not swap.broken and "previous weights were reloaded" in swap.error
        assert len(calls) == 2 and eng.version == v0 + 1 and not eng.broken
        assert "injected" in eng.last_weight_error and "previous weights were reloaded" in eng.last_weight_error
        after = trio.run(lambda: eng.generate(GenerateRequest(prompt_ids(7), sp, seed=7)))
        assert after.policy_version == v0 + 1
        assert after.token_ids.tolist() == before.token_ids.tolist()
        assert np.abs(after.logprobs - before.logprobs).max() < TOL
        assert reference.check(prev, prompt_ids(7), after, 1.0) < TOL
    finally:
        swap_and_wait(eng, v0 + 3, base)


def test_requests_join_a_running_batch_and_aborted_ones_leave_vllm(inproc_engine, tiny_model_dir_hd32, reference):
    eng = inproc_engine
    base = model_state(tiny_model_dir_hd32)
    sp = SamplingParams(temperature=1.0, max_new_tokens=32)
    out = {}
    joins0 = eng.stats()["mid_batch_joins"]

    async def main():
        async def gen(i):
            out[i] = await eng.generate(GenerateRequest(prompt_ids(20 + i), sp, seed=i))

        async def doomed():
            await eng.generate(GenerateRequest(prompt_ids(99), SamplingParams(max_new_tokens=1500), seed=99))

        async with trio.open_nursery() as n:
            cancel = trio.CancelScope()

            async def run_doomed():
                with cancel:
                    await doomed()

            n.start_soon(run_doomed)
            for i in range(2):
                n.start_soon(gen, i)
            await wait_for(lambda: eng.stats()["active"] == 3, "three running")
            steps = eng.stats()["decode_steps"]
            await wait_for(lambda: eng.stats()["decode_steps"] >= steps + 3, "a few steps")
            for i in range(2, 5):  # join the running batch
                n.start_soon(gen, i)
            await wait_for(lambda: len(out) >= 1, "a first result")
            cancel.cancel()
        await wait_for(lambda: eng.stats()["active"] == 0 and not eng.core.has_unfinished_requests(), "vLLM empty")

    trio.run(main)
    assert eng.stats()["mid_batch_joins"] >= joins0 + 3
    assert sorted(out) == list(range(5))
    for i, r in out.items():
        assert r.finish_reason == "length" and len(r.token_ids) == 32
        assert reference.check(base, prompt_ids(20 + i), r, 1.0) < TOL


# ----------------------------------------------------------------------------- multiprocess engine


def test_multiprocess_engine_swaps_inflight_per_token_and_close_mid_request_ends_its_processes(tiny_model_dir_hd32, reference):
    import psutil

    from turnscale.actors.vllm_engine import VLLMEngine
    from tests.vllm.conftest import vllm_cpu_config

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    eng = VLLMEngine(vllm_cpu_config(multiprocess=True, update_mode="inflight", max_batch=4), tiny_model_dir_hd32)
    try:
        # Python's multiprocessing resource tracker is not vLLM's: it ends with this process
        spawned = [p for p in me.children(recursive=True) if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
        assert any("EngineCore" in " ".join(p.cmdline()) for p in spawned), [p.cmdline() for p in spawned]
        base = model_state(tiny_model_dir_hd32)
        new = perturbed(base, seed=4)
        sp = SamplingParams(temperature=1.0, max_new_tokens=48)
        out = {}

        async def main():
            async def gen():
                out["r"] = await eng.generate(GenerateRequest(prompt_ids(5), sp, seed=5))

            async with trio.open_nursery() as n:
                n.start_soon(gen)
                await wait_for(lambda: eng.stats()["decode_steps"] >= 8, "a few tokens")
                eng.load_weights(1, new)  # applied between two decoding steps
            late = await eng.generate(GenerateRequest(prompt_ids(6), sp, seed=6))
            out["late"] = late

        trio.run(main)
        r = out["r"]
        v = r.versions()
        k = int((v == 0).sum())
        assert 0 < k < len(v) and (v[:k] == 0).all() and (v[k:] == 1).all() and r.policy_version == 0
        ids = prompt_ids(5) + r.token_ids.tolist()
        ref0 = reference.logprobs(base, ids, 1.0)[len(prompt_ids(5)):]
        assert np.abs(ref0[:k] - r.logprobs[:k]).max() < TOL  # tokens before the swap: old weights
        assert np.isfinite(r.logprobs).all()
        assert (out["late"].versions() == 1).all()
        assert reference.check(new, prompt_ids(6), out["late"], 1.0) < TOL  # bytes crossed to the worker process intact
        assert eng.last_swap_s > 0

        async def close_mid_request():  # close() stops at a safe point: between two decoding steps
            async with trio.open_nursery() as n:
                async def gen():
                    out["cut"] = await eng.generate(GenerateRequest(prompt_ids(8), SamplingParams(max_new_tokens=1500), seed=8))

                n.start_soon(gen)
                steps = eng.stats()["decode_steps"]
                await wait_for(lambda: eng.stats()["decode_steps"] >= steps + 5, "a running request")
                await trio.to_thread.run_sync(eng.close)

        trio.run(close_mid_request)
        cut = out["cut"]
        assert cut.finish_reason == "aborted" and 0 < len(cut.token_ids) < 1500 and len(cut.logprobs) == len(cut.token_ids)
        assert (cut.versions() == 1).all() and np.isfinite(cut.logprobs).all()
    finally:
        eng.close()
    deadline = time.monotonic() + 60
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in spawned) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p.pid for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"vLLM processes still alive after close(): {alive}"
