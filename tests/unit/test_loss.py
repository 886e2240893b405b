"""Decoupled-PPO, SFT and value losses: gradients at and around their bounds."""

from __future__ import annotations

import math

import pytest
import torch

from turnscale.learner.loss import PPOLossConfig, low_var_kl_BT, ppo_loss, sft_loss, value_loss

CFG = PPOLossConfig(clip_low=0.2, clip_high=0.28, behaviour_cap=2.0)


def _grad(logp, prox, mu, adv, mask, cfg=CFG, num_tokens=None, **kw):
    logp = logp.clone().requires_grad_(True)
    n = float(mask.sum()) if num_tokens is None else num_tokens
    loss, metrics = ppo_loss(logprobs_BT=logp, prox_logprobs_BT=prox, behaviour_logprobs_BT=mu, advantages_BT=adv,
                             mask_BT=mask, num_tokens=n, cfg=cfg, **kw)
    loss.backward()
    return loss, logp.grad, metrics


def test_on_policy_gradient_equals_plain_policy_gradient():
    torch.manual_seed(0)
    # a small softmax policy: logits = x @ W; the loss's parameter gradient must equal REINFORCE's
    x = torch.randn(2, 5, 3)
    W = torch.randn(3, 7, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5))
    adv = torch.randn(2, 5)
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    n = float(mask.sum())

    def logp_of(Wm):
        return torch.log_softmax(x @ Wm, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    lp = logp_of(W)
    loss, _ = ppo_loss(logprobs_BT=lp, prox_logprobs_BT=lp.detach(), behaviour_logprobs_BT=lp.detach(), advantages_BT=adv,
                       mask_BT=mask, num_tokens=n, cfg=CFG)
    (g_ppo,) = torch.autograd.grad(loss, W)
    pg = -(adv * logp_of(W) * mask).sum() / n
    (g_pg,) = torch.autograd.grad(pg, W)
    torch.testing.assert_close(g_ppo, g_pg, rtol=1e-6, atol=1e-7)


def test_on_policy_token_gradient_is_minus_advantage_over_num_tokens():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[0.3, -1.2, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, g, m = _grad(lp, lp, lp, adv, mask, num_tokens=4.0)
    torch.testing.assert_close(g, torch.tensor([[-0.3 / 4, 1.2 / 4, 0.0]]))
    assert m.outside_clip_sum == 0 and m.truncated_sum == 0 and m.weight_sum == 2.0


def test_behaviour_weight_is_truncated_exactly_at_the_cap():
    C = CFG.behaviour_cap
    lp = torch.zeros(1, 3)
    # pi_prox / mu = C * 0.99, exactly C, C * 1.01
    mu = torch.tensor([[-math.log(C * 0.99), -math.log(C), -math.log(C * 1.01)]])
    adv = torch.ones(1, 3)
    _, g, m = _grad(lp, lp, mu, adv, torch.ones(1, 3), num_tokens=1.0)
    torch.testing.assert_close(g, torch.tensor([[-C * 0.99, -C, -C]]))
    assert m.truncated_sum == 1.0
    assert m.weight_max == pytest.approx(C * 1.01, rel=1e-5)


def test_ratio_clipping_acts_exactly_outside_its_bounds():
    hi, lo = 1 + CFG.clip_high, 1 - CFG.clip_low
    d = 1e-3
    prox = torch.zeros(1, 4)
    # ratios just inside / just outside the upper bound (A > 0) and the lower bound (A < 0)
    ratio = torch.tensor([[hi - d, hi + d, lo + d, lo - d]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    _, g, m = _grad(ratio.log(), prox, prox, adv, torch.ones(1, 4), num_tokens=1.0)
    torch.testing.assert_close(g, torch.tensor([[-(hi - d), 0.0, lo + d, 0.0]]))
    assert m.outside_clip_sum == 0  # pi_prox == mu here: the batch is on-policy


def test_clipping_never_stops_a_gradient_that_lowers_a_too_large_ratio():
    # A < 0 with ratio above 1 + eps: the unclipped term is the max, so the gradient flows
    prox = torch.zeros(1, 1)
    _, g, m = _grad(torch.tensor([[math.log(1.5)]]), prox, prox, torch.tensor([[-1.0]]), torch.ones(1, 1), num_tokens=1.0)
    torch.testing.assert_close(g, torch.tensor([[1.5]]))


def test_behaviour_ratios_outside_the_clip_range_are_counted():
    hi, lo = 1 + CFG.clip_high, 1 - CFG.clip_low
    d = 1e-3
    lp = torch.zeros(1, 4)
    w = torch.tensor([[hi - d, hi + d, lo + d, lo - d]])  # pi_prox / mu
    _, _, m = _grad(lp, lp, -w.log(), torch.ones(1, 4), torch.ones(1, 4), num_tokens=1.0)
    assert m.outside_clip_sum == 2.0
    assert m.means()["behaviour_outside_clip_fraction"] == 0.5


def test_masked_tokens_get_zero_gradient_whatever_their_values():
    lp = torch.tensor([[-1.0, -50.0, -0.3]])
    prox = torch.tensor([[-1.0, 30.0, -0.2]])
    mu = torch.tensor([[-1.1, -80.0, -0.1]])
    adv = torch.tensor([[1.0, 1e6, -1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    cfg = PPOLossConfig(kl_coef=0.5, entropy_coef=0.1)
    ent = torch.tensor([[1.0, 9.0, 2.0]], requires_grad=True)
    loss, g, _ = _grad(lp, prox, mu, adv, mask, cfg=cfg, ref_logprobs_BT=torch.tensor([[-2.0, 100.0, -1.0]]), entropy_BT=ent)
    assert g[0, 1] == 0 and g[0, 0] != 0 and g[0, 2] != 0
    assert ent.grad[0, 1] == 0 and torch.isfinite(loss)


def test_micro_batch_gradients_sum_to_the_big_batch_gradient():
    torch.manual_seed(1)
    lp, prox, mu, adv = (torch.randn(4, 6) * 0.3 for _ in range(4))
    mask = (torch.rand(4, 6) > 0.3).float()
    n = float(mask.sum())
    _, g_all, m_all = _grad(lp, prox, mu, adv, mask, num_tokens=n)
    _, g_a, m_a = _grad(lp[:1], prox[:1], mu[:1], adv[:1], mask[:1], num_tokens=n)
    _, g_b, m_b = _grad(lp[1:], prox[1:], mu[1:], adv[1:], mask[1:], num_tokens=n)
    torch.testing.assert_close(torch.cat([g_a, g_b]), g_all)
    merged = m_a.merge(m_b)
    assert merged.means()["behaviour_weight_mean"] == pytest.approx(m_all.means()["behaviour_weight_mean"])


def test_sequence_mask_drops_sequences_outside_the_geometric_mean_band():
    lp = torch.zeros(2, 2)
    mu = torch.tensor([[0.0, 0.0], [-3.0, -3.0]])  # second: pi_prox/mu = e^3 > 2 on every token
    cfg = PPOLossConfig(seq_mask=True, seq_mask_low=0.5, seq_mask_high=2.0, behaviour_cap=100.0)
    _, g, m = _grad(lp, lp, mu, torch.ones(2, 2), torch.ones(2, 2), cfg=cfg)
    assert torch.all(g[1] == 0) and torch.all(g[0] != 0)
    assert m.means()["seq_masked_fraction"] == 0.5


def test_low_var_kl_is_zero_at_equality_and_its_gradient_is_analytic():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    kl = low_var_kl_BT(lp, ref)
    assert kl[0, 0] == 0 and kl[0, 1] > 0
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, 1 - torch.exp(ref - lp.detach()))


def test_kl_and_entropy_terms_need_their_inputs():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_loss(logprobs_BT=z, prox_logprobs_BT=z, behaviour_logprobs_BT=z, advantages_BT=z, mask_BT=z + 1, num_tokens=1,
                 cfg=PPOLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="num_tokens"):
        ppo_loss(logprobs_BT=z, prox_logprobs_BT=z, behaviour_logprobs_BT=z, advantages_BT=z, mask_BT=z, num_tokens=0, cfg=CFG)


def test_sft_loss_is_masked_mean_nll():
    lp = torch.tensor([[-1.0, -2.0, -4.0]])
    assert float(sft_loss(logprobs_BT=lp, mask_BT=torch.tensor([[1, 1, 0]]), num_tokens=2)) == pytest.approx(1.5)


def test_value_loss_is_half_squared_error_over_mask_tokens():
    v = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    loss = value_loss(values_BT=v, returns_BT=torch.tensor([[0.0, 2.0, 0.0]]), mask_BT=torch.tensor([[1, 1, 0]]), num_tokens=2)
    assert float(loss.detach()) == pytest.approx(0.25)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.5, 0.0, 0.0]]))
