"""Test-wide rules: one OpenMP thread in this process and every child; hardware markers skip cleanly."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Child processes started by tests import this checkout (also from a git worktree).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)

import pytest


def _torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    import sys

    if "torch" in sys.modules:
        _torch_threads()


@pytest.fixture(autouse=True)
def _one_thread():
    import sys

    if "torch" in sys.modules:
        _torch_threads()
    yield


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _has_npu() -> bool:
    try:
        import torch_npu  # noqa: F401
        import torch

        return torch.npu.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = npu = None
    for item in items:
        if "gpu" in item.keywords:
            gpu = _has_cuda() if gpu is None else gpu
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "npu" in item.keywords:
            npu = _has_npu() if npu is None else npu
            if not npu:
                item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU with torch-npu"))


# ----------------------------------------------------------------------------- tiny model


def tiny_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """A small synthetic corpus: agent-style text, chat role words, digits."""
    import random

    rng = random.Random(seed)
    words = (
        "system user assistant Thought: Action: Observation: go to the red blue green ball key box door "
        "pick up open toggle turn left right move forward craft get using planks sticks oak log "
        "inventory search answer <search> </search> <answer> </answer> you see a wall ahead steps "
        "your goal is to done success reward the a of and in on"
    ).split()
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    out = []
    for _ in range(n):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(5, 25)))
        out.append(f"{line} {rng.randint(0, 99999)}.\n{rng.choice(words)}")
        # pseudo-words give BPE enough distinct merges to reach a ~1024-token vocabulary
        out.append(" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(9)))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A locally built Qwen2-architecture model + ChatML BPE tokenizer (hidden 64, 2 layers, vocab 1024)."""
    from turnscale.conf.schema import TinyModelConfig
    from turnscale.common.tinymodel import build_tiny_model

    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=1024)
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-model")), cfg, tiny_corpus())
