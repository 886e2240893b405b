"""The same engine on CUDA vLLM (``turnscale[vllm]``): log-probs and a full-state swap.
Marked ``gpu``: skipped without a CUDA GPU (and without vLLM)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

import trio  # noqa: E402

from turnscale.actors.engine import GenerateRequest  # noqa: E402
from turnscale.protocol.messages import SamplingParams  # noqa: E402
from tests.vllm.test_vllm_cpu import TOL, Reference, model_state, perturbed, prompt_ids, swap_and_wait  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_cuda_vllm_logprobs_match_the_learner_before_and_after_a_swap(tiny_model_dir_hd32):
    from turnscale.actors.vllm_engine import VLLMEngine
    from turnscale.conf.schema import EngineConfig, VLLMEngineConfig

    cfg = EngineConfig(name="vllm", device="cuda", dtype="float32", max_batch=8, gpu_memory_utilization=0.3,
                       vllm=VLLMEngineConfig(enforce_eager=True, max_model_len=2048))
    eng = VLLMEngine(cfg, tiny_model_dir_hd32)
    ref = Reference(tiny_model_dir_hd32)
    try:
        sp = SamplingParams(temperature=0.8, max_new_tokens=20)
        base = model_state(tiny_model_dir_hd32)
        res = trio.run(lambda: eng.generate(GenerateRequest(prompt_ids(1), sp, seed=1)))
        assert ref.check(base, prompt_ids(1), res, 0.8) < 1e-3
        new = perturbed(base, seed=1)
        swap_and_wait(eng, 1, new)
        res = trio.run(lambda: eng.generate(GenerateRequest(prompt_ids(2), sp, seed=2)))
        assert res.policy_version == 1 and ref.check(new, prompt_ids(2), res, 0.8) < 1e-3
        assert np.isfinite(res.logprobs).all() and TOL > 0
    finally:
        eng.close()
