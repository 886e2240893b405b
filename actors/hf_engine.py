"""``engine=hf``: transformers ``AutoModelForCausalLM`` on cpu / cuda / npu with continuous batching.

The decoding thread keeps one batched KV cache (``DynamicCache``, left-padded):

- **Joiners** are prefilled together as a left-padded batch (explicit ``position_ids``
  so padding never shifts positions), their first token is sampled, and their cache rows
  are concatenated to the running batch's (both left-padded to a common length).
- **Each step** feeds every row's last sampled token with the full 2-D attention mask
  (0 on padding) and per-row positions, samples one token per row, and removes finished
  rows (``index_select`` on the cache); columns that are padding in every row are trimmed.

Sampling (``sample_tokens``, a pure function): per-row temperature, top-k, top-p, by
inverse-CDF with a per-request seeded uniform stream (``numpy`` generator), so a seed
gives the same draws whatever else is in the batch.  The recorded log-prob is the
``turnscale.logprobs`` convention (full vocabulary, before truncation, float32).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from actors.engine import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineError,
    GenerateResult,
    Pending,
    ThreadedEngine,
)
from turnscale.logprobs import scaled_log_softmax

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    ``logits`` [B, V]; ``temperature`` [B] float (> 0); ``top_k`` [B] long (0: off);
    ``top_p`` [B] float in (0, 1]; ``uniforms`` [B] float in (0, 1].
    Returns ``ids`` [B] long and ``logprobs`` [B] float32 where ``logprobs`` is
    ``log_softmax(logits / temperature)`` at ``ids`` over the full vocabulary.  The draw
    is from the distribution truncated to the top-k tokens and then to the smallest set
    whose mass reaches top-p (the most likely token is always kept).
    """
    lp = scaled_log_softmax(logits, temperature.unsqueeze(-1))
    vocab = lp.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_lp, order = lp.sort(dim=-1, descending=True)
        probs = sorted_lp.exp()
        rank = torch.arange(vocab, device=lp.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
        keep = rank < k
        mass_before = probs.cumsum(-1) - probs
        keep &= (mass_before < top_p.unsqueeze(-1)) | (rank == 0)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    else:
        probs, order = lp.exp(), None
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    pick = torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=vocab - 1)
    ids = pick if order is None else order.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    return ids, lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@dataclass(eq=False)
class _Row:
    """One running request: its sampler state and output so far."""

    p: Pending
    stop: frozenset[int]
    max_new: int
    rng: np.random.Generator
    last: int = -1
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    total_len: int = 0
    """Prompt + generated tokens (the next position id is ``total_len - 1`` for ``last``)."""


class HFEngine(ThreadedEngine):
    """Continuous-batching transformers engine; see the module docstring."""

    def __init__(self, cfg: Any, model_path: str, *, version: int = 0, model: Any = None) -> None:
        super().__init__(max_batch=cfg.max_batch, update_mode=cfg.update_mode, version=version, name="hf")
        self.device = torch.device(cfg.device)
        if self.device.type == "npu":
            import torch_npu  # noqa: F401  (registers the npu device)
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[cfg.dtype])
        self.model = model.to(self.device).eval()
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._names = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self._rows: list[_Row] = []
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x renamed it
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._start()

    # -- ThreadedEngine hooks ----------------------------------------------------------

    def _thread_init(self) -> None:
        torch.set_grad_enabled(False)

    def _active(self) -> list[Pending]:
        return [r.p for r in list(self._rows)]

    def _validate(self, req) -> None:
        super()._validate(req)
        if len(req.prompt_ids) >= self.max_positions:
            raise EngineError(f"prompt of {len(req.prompt_ids)} tokens does not fit the model's {self.max_positions} positions")

    def _admit(self, joiners: list[Pending]) -> list[tuple[Pending, GenerateResult]]:
        rows = []
        for p in joiners:
            s = p.req.sampling
            rows.append(
                _Row(
                    p=p,
                    stop=frozenset(int(t) for t in p.req.stop_token_ids),
                    max_new=min(s.max_new_tokens, self.max_positions - len(p.req.prompt_ids)),
                    rng=np.random.default_rng(p.req.seed),
                    total_len=len(p.req.prompt_ids),
                )
            )
        width = max(r.total_len for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            n = r.total_len
            ids[i, width - n :] = torch.as_tensor(list(r.p.req.prompt_ids), dtype=torch.long)
            mask[i, width - n :] = 1
        pos = (mask.cumsum(-1) - 1).clamp_(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        self._merge(rows, cache, mask.to(self.device))
        return self._sample(rows, out.logits[:, -1, :])

    def _step(self) -> list[tuple[Pending, GenerateResult]]:
        rows = self._rows
        ids = torch.tensor([[r.last] for r in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.total_len - 1] for r in rows], dtype=torch.long, device=self.device)
        mask = torch.cat([self._mask, torch.ones(len(rows), 1, dtype=torch.long, device=self.device)], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._mask = mask  # the cache object grew in place
        return self._sample(list(rows), out.logits[:, -1, :])

    def _drop(self, gone: list[Pending]) -> None:
        ids = {p.rid for p in gone}
        self._keep([i for i, r in enumerate(self._rows) if r.p.rid not in ids])

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._mask = [], None, None

    def _partial_result(self, p: Pending, reason: str) -> GenerateResult:
        for r in self._rows:
            if r.p is p:
                return self._result(r, reason)
        return self._aborted_result(p)

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        for name, t in tensors.items():
            if name not in self._names:
                raise EngineError(f"load_weights: unknown parameter {name!r} (the model has {len(self._names)}, e.g. {next(iter(self._names))!r})")
            if tuple(t.shape) != self._names[name]:
                raise EngineError(f"load_weights: {name} has shape {tuple(t.shape)}, the model needs {self._names[name]}")

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, t in tensors.items():
                state[name].copy_(t)

    # -- batch bookkeeping -------------------------------------------------------------

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor) -> None:
        """Append ``rows`` (with their fresh ``cache`` and ``mask``) to the running batch."""
        if self._cache is None or not self._rows:
            self._rows, self._cache, self._mask = list(rows), cache, mask
            return
        old_w, new_w = self._mask.shape[1], mask.shape[1]
        width = max(old_w, new_w)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, width), _left_pad(new_layer.keys, width)], dim=0)
            old_layer.values = torch.cat([_left_pad(old_layer.values, width), _left_pad(new_layer.values, width)], dim=0)
        self._mask = torch.cat([_left_pad_mask(self._mask, width), _left_pad_mask(mask, width)], dim=0)
        self._rows = self._rows + list(rows)

    def _keep(self, idx: list[int]) -> None:
        """Keep only batch rows ``idx`` and trim columns that are padding in every row."""
        if len(idx) == len(self._rows):
            return
        if not idx:
            self._reset_batch()
            return
        sel = torch.tensor(idx, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, sel)
        first = int(mask.any(dim=0).nonzero()[0, 0]) if bool(mask.any()) else 0
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, sel)[:, :, first:, :]
            layer.values = layer.values.index_select(0, sel)[:, :, first:, :]
        self._mask = mask[:, first:]
        self._rows = [self._rows[i] for i in idx]

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> list[tuple[Pending, GenerateResult]]:
        dev = logits.device
        params = [r.p.req.sampling for r in rows]
        temp = torch.tensor([s.temperature for s in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([s.top_k for s in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([s.top_p for s in params], dtype=torch.float32, device=dev)
        u = torch.tensor([1.0 - r.rng.random() for r in rows], dtype=torch.float32, device=dev)  # (0, 1]
        ids, lps = sample_tokens(logits, temp, top_k, top_p, u)
        ids_l, lps_l = ids.tolist(), lps.tolist()
        done = []
        version = self._version
        for i, r in enumerate(rows):
            tok = ids_l[i]
            r.ids.append(tok)
            r.logprobs.append(lps_l[i])
            r.versions.append(version)
            r.last = tok
            r.total_len += 1
            if tok in r.stop:
                done.append((r.p, self._result(r, FINISH_STOP)))
            elif len(r.ids) >= r.max_new or r.total_len >= self.max_positions:
                done.append((r.p, self._result(r, FINISH_LENGTH)))
        if done:  # ``rows`` may be only the joiners: remove by identity from the whole batch
            gone = {p.rid for p, _ in done}
            self._keep([i for i, r in enumerate(self._rows) if r.p.rid not in gone])
        return done

    def _result(self, r: _Row, reason: str) -> GenerateResult:
        versions = np.asarray(r.versions, dtype=np.int32)
        return GenerateResult(
            token_ids=np.asarray(r.ids, dtype=np.int32),
            logprobs=np.asarray(r.logprobs, dtype=np.float32),
            finish_reason=reason,
            policy_version=int(versions.min()) if len(versions) else self._version,
            latency_s=time.monotonic() - r.p.submitted,
            token_versions=versions,
        )


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, width, D], zeros on the left."""
    extra = width - x.shape[2]
    if extra == 0:
        return x
    return torch.cat([x.new_zeros(x.shape[0], x.shape[1], extra, x.shape[3]), x], dim=2)


def _left_pad_mask(m: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - m.shape[1]
    if extra == 0:
        return m
    return torch.cat([m.new_zeros(m.shape[0], extra), m], dim=1)


__all__ = ["HFEngine", "sample_tokens", "FINISH_ABORTED"]
