"""Losses: decoupled PPO with behaviour correction, masked-NLL SFT, value loss.  Pure
functions of tensors; shapes in the names (``_BT``: batch x tokens, right-padded).

**Normalisation (token mean over the whole batch).**  Every loss here is
``sum over loss-mask tokens of the per-token loss / num_tokens`` where ``num_tokens`` is
the number of loss-mask tokens of the WHOLE optimizer batch (every micro-batch, every
rank), passed in by the caller — not the count in the tensors at hand.  Summing the
gradients of the micro-batches (gradient accumulation: ``backward`` on each, one
optimizer step) therefore gives exactly the gradient of one big batch.  Under DDP, which
averages gradients over ``W`` ranks, pass ``num_tokens = global_tokens / W``.  Sequences
removed by the sequence-level mask still count in ``num_tokens`` (a dropped sequence
shrinks the step, it does not re-weight the others).

**Decoupled PPO** (Hilton et al. 2022; AReaL): with ``r = pi_theta / pi_prox`` and the
behaviour weight ``w = min(pi_prox / mu, C)`` (token level, no gradient), the per-token
loss is ``-w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``; ``mu`` is the actor's
recorded log-prob, ``pi_prox`` the learner's policy before the step.  Optional terms:
``kl_coef * low_var_kl(pi_theta, pi_ref)`` and ``-entropy_coef * H``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from turnscale.conf.schema import PPOLossConfig  # the loss's config; declared in the schema, which embeds it in AlgoConfig

__all__ = ["LossMetrics", "PPOLossConfig", "behaviour_gap_sums_B", "low_var_kl_BT", "ppo_loss", "sft_loss", "value_loss"]


@dataclass(kw_only=True)
class LossMetrics:
    """Token sums (detached floats) so micro-batches combine exactly; ``means()`` reduces.

    Every ``*_sum`` is over loss-mask tokens; ``tokens`` counts them.
    """

    tokens: float = 0.0
    loss_sum: float = 0.0
    outside_clip_sum: float = 0.0
    """Tokens whose behaviour ratio ``pi_prox / mu`` lies outside ``[1 - clip_low, 1 +
    clip_high]``: how far the batch is off-policy, measured on the clip's scale.  (The
    trust-region clip on ``pi_theta / pi_prox`` itself never binds here: with one
    optimizer step per batch that ratio is 1 at the forward, so its clip fraction is 0 by
    construction and is not reported.)"""
    weight_sum: float = 0.0
    weight_max: float = 0.0
    truncated_sum: float = 0.0
    kl_behaviour_sum: float = 0.0
    kl_ref_sum: float = 0.0
    entropy_sum: float = 0.0
    seq_total: float = 0.0
    seq_masked: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def merge(self, other: "LossMetrics") -> "LossMetrics":
        out = LossMetrics()
        for name in ("tokens", "loss_sum", "outside_clip_sum", "weight_sum", "truncated_sum", "kl_behaviour_sum",
                     "kl_ref_sum", "entropy_sum", "seq_total", "seq_masked"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.weight_max = max(self.weight_max, other.weight_max)
        out.extra = {k: self.extra.get(k, 0.0) + other.extra.get(k, 0.0) for k in {*self.extra, *other.extra}}
        return out

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "policy_loss": self.loss_sum / n,
            "behaviour_outside_clip_fraction": self.outside_clip_sum / n,
            "behaviour_weight_mean": self.weight_sum / n,
            "behaviour_weight_max": self.weight_max,
            "truncated_fraction": self.truncated_sum / n,
            "kl_behaviour": self.kl_behaviour_sum / n,
            "kl_ref": self.kl_ref_sum / n,
            "entropy": self.entropy_sum / n,
            "seq_masked_fraction": self.seq_masked / max(self.seq_total, 1.0),
            "tokens": self.tokens,
        }


def low_var_kl_BT(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta:
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0), clamped to [-10, 10] as verl does."""
    d = (ref_logprobs_BT - logprobs_BT).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


def ppo_loss(
    *,
    logprobs_BT: torch.Tensor,
    prox_logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens: float,
    cfg: PPOLossConfig,
    ref_logprobs_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """Decoupled-PPO loss for one micro-batch (see the module docstring).

    Only ``logprobs_BT`` (and ``entropy_BT``) carry gradient; the other inputs are detached
    here.  Tokens with ``mask_BT == 0`` get exactly zero gradient.  Returns the scalar loss
    (sum over this micro-batch's tokens / ``num_tokens``) and token-sum metrics.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    if cfg.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT")
    if cfg.entropy_coef != 0 and entropy_BT is None:
        raise ValueError("entropy_coef != 0 needs entropy_BT")
    mask = mask_BT.to(logprobs_BT.dtype)
    prox = prox_logprobs_BT.detach().to(logprobs_BT.dtype)
    mu = behaviour_logprobs_BT.detach().to(logprobs_BT.dtype)
    adv = advantages_BT.detach().to(logprobs_BT.dtype)

    # Behaviour weight pi_prox / mu, truncated at C (masked tokens: weight 0 via the mask).
    log_w = torch.where(mask > 0, prox - mu, torch.zeros_like(prox))
    raw_w = torch.exp(log_w.clamp(max=30.0))
    w = raw_w.clamp(max=cfg.behaviour_cap)
    if cfg.seq_mask:
        n_seq = mask.sum(-1)
        geo = torch.exp((log_w * mask).sum(-1) / n_seq.clamp(min=1.0))
        keep_S = ((geo >= cfg.seq_mask_low) & (geo <= cfg.seq_mask_high)) | (n_seq == 0)
        eff_mask = mask * keep_S.to(mask.dtype)[:, None]
    else:
        n_seq = mask.sum(-1)
        keep_S = torch.ones_like(n_seq, dtype=torch.bool)
        eff_mask = mask

    # Trust region around pi_prox (masked tokens: logprob difference forced to 0).
    log_ratio = torch.where(mask > 0, logprobs_BT - prox, torch.zeros_like(prox))
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    per_token = w * pg

    ref_kl = None
    if ref_logprobs_BT is not None:
        ref_kl = low_var_kl_BT(logprobs_BT, ref_logprobs_BT.detach().to(logprobs_BT.dtype))
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * ref_kl
    if entropy_BT is not None and cfg.entropy_coef != 0:
        per_token = per_token - cfg.entropy_coef * entropy_BT

    per_token = torch.where(eff_mask > 0, per_token, torch.zeros_like(per_token))
    loss = per_token.sum() / num_tokens

    with torch.no_grad():
        m = mask > 0
        tokens = float(m.sum())
        metrics = LossMetrics(
            tokens=tokens,
            loss_sum=float((per_token.detach()).sum()),
            outside_clip_sum=float((((raw_w < 1.0 - cfg.clip_low) | (raw_w > 1.0 + cfg.clip_high)) & m).sum()),
            weight_sum=float((w * mask).sum()),
            weight_max=float(raw_w[m].max()) if tokens else 0.0,
            truncated_sum=float(((raw_w > cfg.behaviour_cap) & m).sum()),
            kl_behaviour_sum=float(((mu - prox) * mask).sum()),
            kl_ref_sum=float((ref_kl * mask).sum()) if ref_kl is not None else 0.0,
            entropy_sum=float((entropy_BT.detach() * mask).sum()) if entropy_BT is not None else 0.0,
            seq_total=float((n_seq > 0).sum()),
            seq_masked=float(((~keep_S) & (n_seq > 0)).sum()),
        )
    return loss, metrics


@torch.no_grad()
def behaviour_gap_sums_B(
    *, prox_logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, over its loss-mask tokens: ``(tokens_B, abs_gap_sum_B, weight_sum_B)`` with
    the gap ``|mu - pi_prox|`` and the uncapped behaviour weight ``exp(pi_prox - mu)``
    (exponent capped at 30, as in ``ppo_loss``).  Diagnostics only: no gradient, computed
    on CPU in float64 (whatever the device: some have no float64) so a gap of 1e-7 nats
    survives the sums; returns CPU tensors.  Summed over rows: ``ppo_loss``'s token count
    and its behaviour weight before ``behaviour_cap``."""
    keep = (mask_BT > 0).detach().cpu()
    mask = keep.to(torch.float64)
    d = prox_logprobs_BT.detach().to("cpu", torch.float64) - behaviour_logprobs_BT.detach().to("cpu", torch.float64)
    d = torch.where(keep, d, torch.zeros_like(d))
    return mask.sum(-1), (d.abs() * mask).sum(-1), (torch.exp(d.clamp(max=30.0)) * mask).sum(-1)


def sft_loss(*, logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """Masked negative log-likelihood: ``-sum(logp * mask) / num_tokens``."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    lp = torch.where(mask_BT > 0, logprobs_BT, torch.zeros_like(logprobs_BT))
    return -lp.sum() / num_tokens


def value_loss(
    *,
    values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens: float,
) -> torch.Tensor:
    """PPO critic loss ``0.5 * (V - R)^2`` summed over loss-mask tokens / ``num_tokens``.
    (No value clipping: with one optimizer step per batch the critic never moves away from
    its pre-step values within a batch, so a clip around them would never bind.)"""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    R = returns_BT.detach().to(values_BT.dtype)
    err = (values_BT - R) ** 2
    err = torch.where(mask_BT > 0, err, torch.zeros_like(err))
    return 0.5 * err.sum() / num_tokens
