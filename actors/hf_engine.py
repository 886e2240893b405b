"""``engine=hf``: transformers ``AutoModelForCausalLM`` on cpu / cuda / npu with continuous batching.

The decoding thread keeps one batched KV cache (``DynamicCache``, left-padded):

- **Joiners** are prefilled together as a left-padded batch (explicit ``position_ids``
  so padding never shifts positions), their first token is sampled, and their cache rows
  are concatenated to the running batch's (both left-padded to a common length).
- **Each step** feeds every row's last sampled token with the full 2-D attention mask
  (0 on padding) and per-row positions, samples one token per row, and removes finished
  rows (``index_select`` on the cache); columns that are padding in every row are trimmed.

**Prefix reuse** (``PrefixCache``): a finished request's KV (padding removed) is kept; a
new prompt that extends it — the next turn of the same episode — prefills only its new
tokens on top of it (joiners with different cached lengths are left-padded together).
Cleared on every weight swap.  Log-probs stay exact (tested against teacher forcing).

Sampling (``sample_tokens``, a pure function): per-row temperature, top-k, top-p, by
inverse-CDF with a per-request seeded uniform stream (``numpy`` generator), so a seed
gives the same draws whatever else is in the batch.  The recorded log-prob is the
``common.logprobs`` convention (full vocabulary, before truncation, float32).
"""

from __future__ import annotations

import collections
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from turnscale.actors.engine import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineBroken,
    EngineError,
    GenerateResult,
    Pending,
    ThreadedEngine,
)
from turnscale.common.logprobs import scaled_log_softmax
from turnscale.protocol.dtypes import float_torch_dtype


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


class PrefixCache:
    """KV of finished requests, reused when a new prompt extends one (the next turn of an episode).

    Entries are ``(token ids [n], per-layer (keys, values) [1, H, n, D])`` with padding
    removed (cached keys already carry their rotary positions, so dropping padding columns
    is exact).  ``take(prompt)`` removes and returns the longest entry whose ids are a
    prefix of ``prompt``, cut to leave at least one prompt token to compute.  At most
    ``max_tokens`` tokens are kept (least recently stored dropped first); 0 disables.
    The engine clears it whenever weights change.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[int, tuple[np.ndarray, list]] = collections.OrderedDict()
        self._tokens = 0
        self._next = 0
        self.reused_tokens = 0

    def put(self, ids: np.ndarray, kv: list) -> None:
        if not self.max_tokens or len(ids) == 0 or len(ids) > self.max_tokens:
            return
        self._entries[self._next] = (ids, kv)
        self._next += 1
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            _, (old, _) = self._entries.popitem(last=False)
            self._tokens -= len(old)

    def take(self, prompt: np.ndarray) -> tuple[np.ndarray, list]:
        best, best_n = None, 0
        for key, (ids, _) in self._entries.items():
            n = len(ids)
            if best_n < n <= len(prompt) and ids[-1] == prompt[n - 1] and np.array_equal(ids, prompt[:n]):
                best, best_n = key, n
        if best is None:
            return np.zeros(0, np.int64), []
        ids, kv = self._entries.pop(best)
        self._tokens -= len(ids)
        m = min(len(ids), len(prompt) - 1)
        if m <= 0:
            return np.zeros(0, np.int64), []
        if m < len(ids):
            ids, kv = ids[:m], [(k[:, :, :m], v[:, :, :m]) for k, v in kv]
        return ids, kv

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)


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
    kv_version: int = 0
    """Weights version at admission; the row's KV is reusable only if no swap happened since."""


class HFEngine(ThreadedEngine):
    """Continuous-batching transformers engine; see the module docstring."""

    def __init__(self, cfg: Any, model_path: str, *, version: int = 0, model: Any = None, prefix_cache_tokens: int = 1 << 17) -> None:
        super().__init__(max_batch=cfg.max_batch, update_mode=cfg.update_mode, version=version, name="hf")
        self.device = torch.device(cfg.device)
        if self.device.type == "npu":
            import torch_npu  # noqa: F401  (registers the npu device)
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=float_torch_dtype(cfg.dtype, "engine.dtype"))
        self.model = model.to(self.device).eval()
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._names = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        self._rows: list[_Row] = []
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x renamed it
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
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
                    kv_version=self._version,
                )
            )
        prompts = [np.asarray(p.req.prompt_ids, dtype=np.int64) for p in joiners]
        reused = [self.prefix_cache.take(q) for q in prompts]
        past_w = max(len(ids) for ids, _ in reused)
        width = max(len(q) - len(ids) for q, (ids, _) in zip(prompts, reused))
        n = len(rows)
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, past_w + width, dtype=torch.long)
        pos = torch.zeros(n, width, dtype=torch.long)
        for i, (q, (cached, _)) in enumerate(zip(prompts, reused)):
            m, k = len(cached), len(q) - len(cached)
            ids[i, width - k :] = torch.from_numpy(q[m:])
            mask[i, past_w - m : past_w] = 1
            mask[i, past_w + width - k :] = 1
            pos[i, width - k :] = torch.arange(m, m + k)
        self.prefix_cache.reused_tokens += sum(len(c) for c, _ in reused)
        cache = _new_cache(self.model.config)
        if past_w:
            for layer, (k, v) in enumerate(_stack_past([kv for _, kv in reused], past_w)):
                cache.update(k.to(self.device), v.to(self.device), layer)
        mask = mask.to(self.device)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask,
            position_ids=pos.to(self.device),
            use_cache=True,
            **{self._cache_kw: cache},
            **self._keep_last,
        )
        self._merge(rows, cache, mask)
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

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["prefix_reused_tokens"] = float(self.prefix_cache.reused_tokens)
        out["prefix_cache_entries"] = float(len(self.prefix_cache))
        return out

    def _drop(self, gone: list[Pending]) -> None:
        ids = {p.rid for p in gone}
        self._keep([i for i, r in enumerate(self._rows) if r.p.rid not in ids])

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._mask = [], None, None

    def _row_of(self, p: Pending) -> _Row | None:
        return next((r for r in self._rows if r.p is p), None)

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        for name, t in tensors.items():
            if name not in self._names:
                raise EngineError(f"load_weights: unknown parameter {name!r} (the model has {len(self._names)}, e.g. {next(iter(self._names))!r})")
            if tuple(t.shape) != self._names[name]:
                raise EngineError(f"load_weights: {name} has shape {tuple(t.shape)}, the model needs {self._names[name]}")

    def weights_digest(self, names, dtype: str, algo: str) -> dict[str, int]:
        """Checksums of the model's parameters as the transfer dtype (a lossless round trip
        for weights that came in as that dtype), read without stopping the decoding thread
        (only a swap writes them, and the caller does not start one meanwhile)."""
        from turnscale.actors.engine import tensor_digest

        state = self.model.state_dict()
        return tensor_digest({n: state[n] for n in names if n in state}, dtype, algo)

    def storage_dtypes(self, names) -> dict[str, torch.dtype]:
        """See ``Engine.storage_dtypes``."""
        state = self.model.state_dict()
        return {n: state[n].dtype for n in names if n in state}

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        """Copy every tensor into the model (names and shapes were checked at hand-over).

        The copy writes the live parameters in place, so a failure part-way has already
        overwritten some of them: that is ``EngineBroken``, never "kept the old version"."""
        self.prefix_cache.clear()  # KV computed by the old weights must not seed new requests
        state = self.model.state_dict()
        done = 0
        try:
            with torch.no_grad():
                for name, t in tensors.items():
                    state[name].copy_(t)
                    done += 1
        except Exception as exc:
            if done == 0:
                raise
            raise EngineBroken(f"weight copy failed after {done} of {len(tensors)} tensors: "
                               f"{type(exc).__name__}: {exc}") from None

    # -- batch bookkeeping -------------------------------------------------------------

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor) -> None:
        """Append ``rows`` (with their fresh ``cache`` and ``mask``) to the running batch."""
        if self._cache is None or not self._rows:
            self._rows, self._cache, self._mask = list(rows), cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        new_kv = _cache_tensors(cache)
        _map_cache(self._cache, lambda i, kind, x: torch.cat([_left_pad(x, width), _left_pad(new_kv[i][kind], width)], dim=0))
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
        _map_cache(self._cache, lambda i, kind, x: x.index_select(0, sel)[:, :, first:, :])
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
                done.append((r.p, self._row_result(r, FINISH_STOP)))
            elif len(r.ids) >= r.max_new or r.total_len >= self.max_positions:
                done.append((r.p, self._row_result(r, FINISH_LENGTH)))
        if done:  # ``rows`` may be only the joiners: remove by identity from the whole batch
            gone = {p.rid for p, _ in done}
            if self.prefix_cache.max_tokens:
                self._stash([i for i, r in enumerate(self._rows) if r.p.rid in gone])
            self._keep([i for i, r in enumerate(self._rows) if r.p.rid not in gone])
        return done

    def _stash(self, idx: list[int]) -> None:
        """Keep finished rows' KV (padding columns removed) for a follow-up turn to reuse."""
        kv = _cache_tensors(self._cache)
        for i in idx:
            r = self._rows[i]
            if r.kv_version != self._version:  # an in-flight swap: part of its KV is old weights'
                continue
            cols = self._mask[i].nonzero().squeeze(-1)
            tokens = np.concatenate([np.asarray(r.p.req.prompt_ids, dtype=np.int64), np.asarray(r.ids[:-1], dtype=np.int64)])
            if len(cols) != len(tokens):  # never expected; reuse must be exact or nothing
                continue
            self.prefix_cache.put(tokens, [(k[i : i + 1].index_select(2, cols), v[i : i + 1].index_select(2, cols)) for k, v in kv])


def _stack_past(kvs: list[list], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, each row's cached ``(keys, values)`` left-padded to ``width`` and stacked
    on the batch dimension; rows with nothing cached get zeros (masked out)."""
    ref = next(kv for kv in kvs if kv)
    out = []
    for layer, (k0, v0) in enumerate(ref):
        def pad(kv, j, x0):
            return _left_pad(kv[layer][j], width) if kv else x0.new_zeros(1, x0.shape[1], width, x0.shape[3])

        out.append((torch.cat([pad(kv, 0, k0) for kv in kvs]), torch.cat([pad(kv, 1, v0) for kv in kvs])))
    return out


def _new_cache(config: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56
        return DynamicCache()


def _cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)``, each ``[B, H, S, D]`` (``.layers`` API or the older lists)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _map_cache(cache: Any, fn: Any) -> None:
    """Replace every cached tensor ``x`` of layer ``i`` by ``fn(i, kind, x)`` (kind 0: keys, 1: values)."""
    if hasattr(cache, "layers"):
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = fn(i, 0, layer.keys), fn(i, 1, layer.values)
    else:
        cache.key_cache = [fn(i, 0, k) for i, k in enumerate(cache.key_cache)]
        cache.value_cache = [fn(i, 1, v) for i, v in enumerate(cache.value_cache)]


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
