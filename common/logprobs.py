"""The one log-prob convention shared by actors (behaviour policy) and the learner.

``token_logprobs(logits, ids, temperature)`` = ``log_softmax(logits / temperature)``
over the full vocabulary, in float32, gathered at ``ids`` — computed *before* any
top-p / top-k truncation (``protocol.messages.SamplingParams``).  The actor's engine
records this value for every sampled token; the learner recomputes it from its own
forward pass; with identical weights both agree to float32 rounding.

Only torch is imported (lazily by the caller's tensors): no protocol, no transformers.
"""

from __future__ import annotations

import torch


def scaled_log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits -> ``[..., V]`` float32 ``log_softmax(logits / temperature)``.

    ``temperature`` is a float or a tensor broadcastable to ``logits[..., :1]`` (one per row).
    """
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        x = x / temperature.to(x.dtype)
    elif temperature != 1.0:
        x = x / float(temperature)
    return torch.log_softmax(x, dim=-1)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Log-prob of ``ids`` under ``logits``: ``[..., V]`` logits, ``[...]`` ids -> ``[...]`` float32.

    For a causal LM over a token stream ``x[0..T)``, the log-prob of ``x[t]`` comes from
    the logits at position ``t - 1``: ``token_logprobs(logits[:, :-1], x[:, 1:], T)``.
    """
    lp = scaled_log_softmax(logits, temperature)
    return lp.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
