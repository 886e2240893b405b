"""Build a tiny HF model + tokenizer locally (no downloads), loadable like a real model.

``build_tiny_model`` writes a folder that ``AutoTokenizer.from_pretrained`` and
``AutoModelForCausalLM.from_pretrained`` load exactly as they load Qwen2.5:

- a Qwen2-architecture decoder (``Qwen2Config``), randomly initialised from ``cfg.seed``;
- a byte-level BPE tokenizer trained with the ``tokenizers`` library on ``corpus``, with
  the special tokens ``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos),
  and a ChatML chat template (transformers 5.x writes it to ``chat_template.jinja``).

Tokenizer invariant (FACTS.md gotcha): transformers 5.x loads a ``qwen2`` tokenizer as
``Qwen2Tokenizer``, which rebuilds the normaliser and pre-tokenizer (NFC, Qwen's split
regex, ByteLevel without regex) around the saved vocab and merges.  We train with exactly
that pipeline, so ``tokenizer.json`` read by the ``tokenizers`` library and
``AutoTokenizer`` give identical ids (tested, digits included).

``ensure_model`` resolves ``model.path``: a real reference is returned unchanged; ``tiny``
is built once into a folder named by a hash of the config and the corpus (atomic:
temporary folder + rename), so every process of a run shares one copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable, Iterable

from turnscale.conf.schema import ModelConfig, TinyModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Ids 0, 1, 2 of every tiny tokenizer, in this order."""

QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenizer regex (transformers ``models/qwen2/tokenization_qwen2.py``)."""

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen2.5 renders it (without Qwen's default system message and tool calls)."""


def build_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHATML_TEMPLATE,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    bos_token: str | None = None,
    model_max_length: int = 4096,
):
    """A ``PreTrainedTokenizerFast`` over a byte-level BPE trained on ``corpus``.

    ``special_tokens`` get ids 0.. in order.  Used for the tiny model (ChatML) and by tests
    for other template families (Llama-3 style).
    """
    from transformers import PreTrainedTokenizerFast

    raw = _train_tokenizer(corpus, vocab_size, special_tokens)
    extra = [t for t in special_tokens if t not in (eos_token, pad_token, bos_token)]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        unk_token=None,
        additional_special_tokens=extra,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = chat_template
    return tok


def _train_tokenizer(corpus: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def build_tiny_model(out_dir: str, cfg: TinyModelConfig, corpus: Iterable[str]) -> str:
    """Train the tokenizer on ``corpus``, build a random Qwen2 model, save both to ``out_dir``.

    Returns ``out_dir``.  Deterministic for a given ``cfg`` and corpus (torch seeded with
    ``cfg.seed``; BPE training is deterministic).  ``cfg.vocab_size`` is the BPE target; a
    small corpus may yield fewer tokens, and the model's vocabulary is the tokenizer's
    actual size, so every id the model can sample is a real token.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if cfg.architecture != "qwen2":
        raise ValueError(f"config key 'model.tiny.architecture': {cfg.architecture!r} not supported; use qwen2")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(corpus, cfg.vocab_size, model_max_length=cfg.max_position_embeddings)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _mark_tokenizer_class(out_dir)
    return out_dir


def _mark_tokenizer_class(out_dir: str) -> None:
    """Name the tokenizer class Qwen2Tokenizer (what a real Qwen2 checkpoint says)."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        data = json.load(f)
    data["tokenizer_class"] = "Qwen2Tokenizer"
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def corpus_fingerprint(corpus: Iterable[str]) -> str:
    h = hashlib.sha256()
    for text in corpus:
        h.update(text.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def tiny_model_key(cfg: TinyModelConfig, corpus: Iterable[str]) -> str:
    """Hash of the config and the corpus: the cache folder's name."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode())
    h.update(corpus_fingerprint(corpus).encode())
    h.update(b"tinymodel-v2")
    return h.hexdigest()[:16]


def ensure_model(model: ModelConfig, corpus_fn: Callable[[], Iterable[str]]) -> str:
    """Return a loadable model reference: ``model.path`` unless it is ``tiny``.

    For ``tiny``: builds once into ``<cache>/tiny-<hash>`` where ``<cache>`` is
    ``model.cache_dir`` or ``~/.cache/turnscale``; concurrent builders race harmlessly
    (each builds in its own temporary folder; the first rename wins, the rest discard).
    ``corpus_fn`` is called (up to twice: fingerprint, then training) only for ``tiny``.
    """
    if model.path != "tiny":
        return model.path
    cache = model.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "turnscale")
    os.makedirs(cache, exist_ok=True)
    corpus = list(corpus_fn())
    final = os.path.join(cache, f"tiny-{tiny_model_key(model.tiny, corpus)}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    tmp = tempfile.mkdtemp(prefix=".tiny-build-", dir=cache)
    try:
        build_tiny_model(tmp, model.tiny, corpus)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
