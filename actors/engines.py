"""``make_engine``: the engine ``cfg.name`` names, built for a model folder.

The factory imports the engine modules (``hf_engine``, ``vllm_engine``, ``sim_engine``)
lazily, so only the chosen engine's dependencies load; the interface (``actors.engine``)
imports no engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnscale.actors.engine import Engine, EngineError

if TYPE_CHECKING:
    from turnscale.conf.schema import EngineConfig


def make_engine(cfg: "EngineConfig", model_path: str, tokenizer: Any = None, *, version: int = 0) -> Engine:
    """Build the engine ``cfg.name`` names (``hf``, ``vllm``, ``sim``) for ``model_path``.

    ``tokenizer`` is needed only by ``sim`` (loaded from ``model_path`` when None).
    """
    if cfg.name == "hf":
        from turnscale.actors.hf_engine import HFEngine

        return HFEngine(cfg, model_path, version=version)
    if cfg.name == "vllm":
        from turnscale.actors.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, model_path, version=version)
    if cfg.name == "sim":
        from turnscale.actors.sim_engine import SimEngine

        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
        return SimEngine(cfg, tokenizer, version=version)
    raise EngineError(f"unknown engine {cfg.name!r}; choose hf, vllm or sim")
