"""The log-prob convention shared by actors and learner (``protocol.messages.SamplingParams``).

``logprobs_BT[:, t] = log_softmax(logits_BTV[:, t - 1] / temperature)[input_ids_BT[:, t]]``
over the full vocabulary, in float32, before any top-p/top-k truncation; position 0 has
no predecessor and gets 0.  So ``logprobs_BT`` lines up with ``Episode.logprobs`` (the
log-prob of the token AT each position), and identical weights give identical numbers.
"""

from __future__ import annotations

import torch


def token_logprobs_BT(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] float32 log-prob of each token given the ones before it (0 at position 0).

    Differentiable; computed as ``logit[id] / temp - logsumexp(logits / temp)`` so no
    [B, T, V] log-softmax tensor is kept beyond the float32 logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits_BTV[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids_BT[:, 1:].long()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lp = picked - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0), value=0.0)


def token_entropy_BT(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, T] float32 entropy of the sampling distribution that produced token t (the one
    predicted from position t - 1); 0 at position 0.  Aligned like ``token_logprobs_BT``."""
    logits = logits_BTV[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)
