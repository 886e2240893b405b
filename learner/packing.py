"""Padding-free micro-batches: episodes packed end to end in one row, attention kept
inside each episode (``algo.packing=varlen``, the default).

Invariants (tested against the padded path in ``tests/unit/test_packing.py``):

- A ``Pack`` is one row ``[1, N]`` of whole sequences back to back, ``N`` = the sum of
  their lengths: no padding is computed, so padded tokens per real token is exactly 1.
- Position ids restart at 0 for every sequence, so rotary embeddings see the positions
  the padded path gives them.
- Attention never crosses a sequence boundary: ``varlen_sdpa`` runs causal
  ``scaled_dot_product_attention`` once per sequence (boundaries from ``cu_seq_lens_q``,
  the keyword transformers' varlen kernels use), so its cost is ``sum(len_i**2)``, not
  ``N**2``.  The model must be switched to it with ``use_varlen_attention(model)``;
  without ``cu_seq_lens_q`` (a plain padded call) it is transformers' own SDPA, so the same
  model serves both layouts.
- Per-token outputs go back to the padded ``[B, T]`` layout with ``Pack.unpack_BT``
  (zero at pad positions; ``shifted=True`` also zeroes column 0, whose packed value was
  predicted from the previous sequence), so advantages, losses and metrics run on the
  same ``[B, T]`` tensors as before and give the same numbers within float tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

VARLEN_ATTENTION = "turnscale_varlen"
"""Name under which ``varlen_sdpa`` is registered with transformers' attention interface."""


def plan_packs(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into packs of at most ``token_budget`` real tokens
    (first-fit decreasing; a sequence longer than the budget goes alone).  Every index
    appears exactly once; deterministic (ties by index)."""
    if token_budget <= 0:
        raise ValueError(f"token_budget must be > 0, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    packs: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = int(lengths[i])
        for k, u in enumerate(used):
            if u + n <= token_budget:
                packs[k].append(i)
                used[k] += n
                break
        else:
            packs.append([i])
            used.append(n)
    return packs


@dataclass(frozen=True)
class Pack:
    """One packed row and the map back to the padded layout.

    Example: sequences of lengths 3 and 2 give ``input_ids_1N`` ``[[a0 a1 a2 b0 b1]]``,
    ``position_ids_1N`` ``[[0 1 2 0 1]]``, ``cu_seq_lens`` ``[0 3 5]`` and ``index_BT``
    ``[[0 1 2] [3 4 0]]`` with ``valid_BT`` ``[[1 1 1] [1 1 0]]``.
    """

    input_ids_1N: torch.Tensor
    """[1, N] int64 token ids of every sequence back to back."""
    position_ids_1N: torch.Tensor
    """[1, N] int64 position of each token within its own sequence."""
    cu_seq_lens: torch.Tensor
    """[B + 1] int32 cumulative lengths: sequence b is ``[cu[b], cu[b + 1])``."""
    index_BT: torch.Tensor
    """[B, T] int64 packed position of each padded-layout token (0 at pads)."""
    valid_BT: torch.Tensor
    """[B, T] bool: a real token (not padding)."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids_1N.shape[1])

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the HF model's forward (no attention mask: the sequence
        boundaries travel as ``cu_seq_lens_*``)."""
        lengths = self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]
        longest = int(lengths.max()) if len(lengths) else 0
        return {"input_ids": self.input_ids_1N, "position_ids": self.position_ids_1N,
                "cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": longest, "max_length_k": longest}

    def pack_1N(self, rows: Sequence[np.ndarray]) -> torch.Tensor:
        """Per-sequence 1-D arrays (the same lengths as the pack's) concatenated to ``[1, N]``."""
        return torch.from_numpy(np.concatenate([np.asarray(r) for r in rows])[None]).to(self.input_ids_1N.device)

    def unpack_BT(self, x_1N: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
        """``[1, N, ...]`` per-token values in the padded ``[B, T, ...]`` layout, zero at pads
        (differentiable).  ``shifted``: a value at token t that was computed from token
        t - 1 (log-probs, entropies); column 0 is zeroed as the padded path has no predecessor."""
        out = x_1N[0][self.index_BT]
        keep = self.valid_BT
        if shifted:
            keep = keep.clone()
            keep[:, 0] = False
        keep = keep.reshape(*keep.shape, *([1] * (out.dim() - 2)))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def pack_sequences(rows: Sequence[np.ndarray], device: torch.device | str = "cpu") -> Pack:
    """Pack the 1-D token arrays ``rows`` (in this order) into one ``Pack``."""
    if not rows:
        raise ValueError("cannot pack zero sequences")
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    if (lengths <= 0).any():
        raise ValueError(f"cannot pack an empty sequence (lengths {lengths.tolist()})")
    cu = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    T = int(lengths.max())
    col = np.arange(T)[None, :]
    valid = col < lengths[:, None]
    index = np.where(valid, cu[:-1, None] + col, 0)
    return Pack(
        input_ids_1N=torch.from_numpy(ids[None]).to(device),
        position_ids_1N=torch.from_numpy(pos[None]).to(device),
        cu_seq_lens=torch.from_numpy(cu.astype(np.int32)).to(device),
        index_BT=torch.from_numpy(index).to(device),
        valid_BT=torch.from_numpy(valid).to(device),
    )


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface``: with ``cu_seq_lens_q`` (a packed
    row, batch 1) causal SDPA per sequence; otherwise transformers' SDPA unchanged.
    ``query`` is ``[1, H, N, D]``, ``key``/``value`` ``[1, H_kv, N, D]``; returns ``[1, N, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("varlen attention takes one packed row and no attention mask")
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    bounds = cu.tolist()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask builder paired with ``varlen_sdpa``: none for a packed row (the attention
    splits by ``cu_seq_lens``, so no ``N x N`` mask is ever built), SDPA's mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def use_varlen_attention(model: Any) -> None:
    """Register ``varlen_sdpa`` with transformers (idempotent) and switch ``model`` (an
    unwrapped HF model) to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, _varlen_mask)
    model.set_attn_implementation(VARLEN_ATTENTION)
