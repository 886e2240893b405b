from __future__ import annotations

import os

import pytest

from turnscale.conf.schema import ModelConfig, TinyModelConfig
from tests.conftest import tiny_corpus
from turnscale.common import tinymodel


def test_tokenizer_json_and_autotokenizer_give_identical_ids(tiny_model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(os.path.join(tiny_model_dir, "tokenizer.json"))
    for text in ["craft 4 oak planks using 1 oak log", "12345 steps 3.14159 x2y 007", "Action:  go\n\n\tleft  ÄÖü",
                 "<|im_start|>user\nhi 42<|im_end|>\n"]:
        assert auto.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>"


def test_tiny_model_loads_like_a_real_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert os.path.isfile(os.path.join(tiny_model_dir, "chat_template.jinja"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64
    assert model.config.eos_token_id == tok.eos_token_id
    out = model(torch.tensor([tok.encode(text)])).logits
    assert out.shape[-1] == len(tok) == model.config.vocab_size and torch.isfinite(out).all()
    assert 900 <= len(tok) <= 1024  # the fixture corpus is rich enough for the BPE target


def test_ensure_model_builds_tiny_once_and_passes_real_paths_through(tmp_path, monkeypatch):
    cfg = ModelConfig(path="tiny", cache_dir=str(tmp_path), tiny=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=300))
    calls = []
    real = tinymodel.build_tiny_model
    monkeypatch.setattr(tinymodel, "build_tiny_model", lambda *a: calls.append(a) or real(*a))
    corpus = lambda: tiny_corpus(50)  # noqa: E731
    first = tinymodel.ensure_model(cfg, corpus)
    second = tinymodel.ensure_model(cfg, corpus)
    assert first == second and len(calls) == 1
    assert os.path.basename(first).startswith("tiny-") and os.path.isfile(os.path.join(first, "config.json"))
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tiny-build")] == []
    other = tinymodel.ensure_model(cfg, lambda: tiny_corpus(60))
    assert other != first
    assert tinymodel.ensure_model(ModelConfig(path="Qwen/Qwen2.5-7B-Instruct"), corpus) == "Qwen/Qwen2.5-7B-Instruct"


def test_unsupported_architecture_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="model.tiny.architecture"):
        tinymodel.build_tiny_model(str(tmp_path), TinyModelConfig(architecture="llama"), ["a"])
