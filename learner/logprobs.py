"""The learner's side of the log-prob convention (``protocol.messages.SamplingParams``).

The convention itself lives in ``common.logprobs`` (shared with the actors' engines:
``scaled_log_softmax`` = float32 ``log_softmax(logits / temperature)`` over the full
vocabulary); this module applies it to teacher-forced ``[B, T]`` streams:

``logprobs_BT[:, t] = log_softmax(logits_BTV[:, t - 1] / temperature)[input_ids_BT[:, t]]``
over the full vocabulary, in float32, before any top-p/top-k truncation; position 0 has
no predecessor and gets 0.  So ``logprobs_BT`` lines up with ``Episode.logprobs`` (the
log-prob of the token AT each position), and identical weights give identical numbers.
Entropies line up the same way: ``entropy_BT[:, t]`` is the entropy of the distribution
token t was sampled from.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from turnscale.common.logprobs import scaled_log_softmax


def _log_softmax(logits_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return scaled_log_softmax(logits_BTV, temperature)


def logprobs_and_entropy_BT(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy_mask_BT: torch.Tensor | None = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] log-probs (differentiable) and [B, T] entropies from one float32 log-softmax.

    Entropies are computed only where ``entropy_mask_BT`` is set (0 elsewhere; all
    positions when None) and carry gradient only with ``entropy_grad`` — the learner needs
    them on loss-mask tokens, as a metric unless the entropy bonus is on.
    """
    lsm = _log_softmax(logits_BTV, temperature)
    B, T = input_ids_BT.shape
    lp = lsm[:, :-1].gather(-1, input_ids_BT[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    lp = torch.nn.functional.pad(lp, (1, 0), value=0.0)
    with nullcontext() if entropy_grad else torch.no_grad():
        src = lsm[:, :-1] if entropy_grad else lsm[:, :-1].detach()
        sel = torch.ones(B, T - 1, dtype=torch.bool, device=lsm.device) if entropy_mask_BT is None else entropy_mask_BT[:, 1:] > 0
        rows = src[sel]
        ent_sel = -(rows.exp() * rows).sum(-1)
        ent = torch.zeros(B, T, dtype=lsm.dtype, device=lsm.device)
        ent[:, 1:] = ent[:, 1:].masked_scatter(sel, ent_sel)
    return lp, ent


def token_logprobs_BT(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] float32 log-prob of each token given the ones before it (0 at position 0)."""
    lsm = _log_softmax(logits_BTV, temperature)
    lp = lsm[:, :-1].gather(-1, input_ids_BT[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0), value=0.0)


def token_entropy_BT(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] float32 entropy of the distribution token t was sampled from (0 at t = 0)."""
    lsm = _log_softmax(logits_BTV[:, :-1], temperature)
    return torch.nn.functional.pad(-(lsm.exp() * lsm).sum(-1), (1, 0), value=0.0)
