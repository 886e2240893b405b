"""Advantage estimators against hand-computed values (multi-turn masks, truncation)."""

from __future__ import annotations

import numpy as np
import pytest

from turnscale.learner import advantages as A


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    # mean 0.5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.866025
    got = A.grpo_G(np.array([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    np.testing.assert_allclose(got, [0.8660254, -0.8660254, -0.8660254, 0.8660254], rtol=1e-6)


def test_dr_grpo_subtracts_the_mean_only():
    np.testing.assert_allclose(A.dr_grpo_G(np.array([3.0, 1.0, 2.0])), [1.0, -1.0, 0.0])


def test_rloo_uses_the_leave_one_out_baseline():
    # r_i - mean of the others: 1 - 0, 0 - 1/3, 0 - 1/3, 0 - 1/3
    np.testing.assert_allclose(A.rloo_G(np.array([1.0, 0.0, 0.0, 0.0])), [1.0, -1 / 3, -1 / 3, -1 / 3])
    np.testing.assert_allclose(A.rloo_G(np.array([2.0, 4.0])), [-2.0, 2.0])


@pytest.mark.parametrize("name", sorted(A.GROUP_ESTIMATORS))
def test_equal_reward_groups_get_zero_advantages_and_are_counted(name):
    assert np.all(A.group_advantages_G(name, np.array([0.7, 0.7, 0.7])) == 0)
    assert np.all(A.group_advantages_G(name, np.array([1.0])) == 0)
    assert A.count_degenerate([np.array([1.0, 1.0]), np.array([0.0, 1.0]), np.array([0.0, 0.0, 0.0])]) == 2


def test_outcome_reward_lands_on_the_last_trainable_token_not_the_last_token():
    mask = np.array([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    got = A.outcome_rewards_BT(np.array([3.0, 5.0]), mask)
    np.testing.assert_array_equal(got, [[0, 0, 3.0, 0, 0], [0, 0, 0, 0, 0]])


def test_discounted_returns_skip_observation_tokens():
    # steps at t=1,2,4 (t=3 is an observation token): G = 0.5^2*2, 0.5*2, 2
    mask = np.array([[0, 1, 1, 0, 1]])
    rewards = np.array([[0, 0, 0, 0, 2.0]])
    np.testing.assert_allclose(A.discounted_returns_BT(rewards, mask, 0.5), [[0, 0.5, 1.0, 0, 2.0]])


def test_rewards_outside_the_mask_are_rejected():
    with pytest.raises(ValueError, match="outside the loss mask"):
        A.discounted_returns_BT(np.array([[0, 0, 1.0]]), np.array([[0, 1, 0]]), 1.0)


def test_reinforce_pp_whitens_returns_over_the_batch_and_zeroes_excluded_rows():
    mask = np.array([[1, 1, 0], [0, 1, 1], [1, 1, 1]])
    rewards = A.outcome_rewards_BT(np.array([1.0, 0.0, 7.0]), mask)
    got = A.reinforce_pp_BT(rewards, mask, gamma=1.0, keep_B=np.array([True, True, False]), eps=0.0)
    # kept token returns [1, 1, 0, 0]: mean 0.5, std 0.5
    np.testing.assert_allclose(got, [[1, 1, 0], [0, -1, -1], [0, 0, 0]])


MT_MASK = np.array([[0, 1, 1, 0, 0, 1, 0]])  # prompt, turn 1 (2 tokens), observation (2), turn 2 (1), obs
MT_VALUES = np.array([[9.0, 0.5, 0.6, 99.0, 99.0, 0.8, 99.0]])  # values off the mask must not matter


def test_gae_runs_over_trainable_tokens_of_a_multi_turn_episode():
    rewards = A.outcome_rewards_BT(np.array([1.0]), MT_MASK)
    adv, ret = A.gae_BT(rewards, MT_VALUES, MT_MASK, gamma=0.9, lam=0.5)
    # steps k=1,2,3 at t=1,2,5 with V = .5, .6, .8; done => V_4 = 0
    # d3 = 1 - .8 = .2;  d2 = .9*.8 - .6 = .12;  d1 = .9*.6 - .5 = .04
    # A3 = .2;  A2 = .12 + .45*.2 = .21;  A1 = .04 + .45*.21 = .1345
    np.testing.assert_allclose(adv, [[0, 0.1345, 0.21, 0, 0, 0.2, 0]], atol=1e-12)
    np.testing.assert_allclose(ret, [[0, 0.6345, 0.81, 0, 0, 1.0, 0]], atol=1e-12)


def test_gae_bootstraps_a_truncated_episode_with_the_value_after_the_stream():
    rewards = np.zeros_like(MT_VALUES)  # truncated at the turn limit: no outcome reward
    adv, _ = A.gae_BT(rewards, MT_VALUES, MT_MASK, gamma=0.9, lam=0.5, bootstrap_B=np.array([0.7]))
    # d3 = .9*.7 - .8 = -.17;  A2 = .12 + .45*(-.17) = .0435;  A1 = .04 + .45*.0435 = .059575
    np.testing.assert_allclose(adv, [[0, 0.059575, 0.0435, 0, 0, -0.17, 0]], atol=1e-12)


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    mask = np.array([[1, 0, 1, 1], [1, 1, 0, 0]])
    values = np.array([[0.1, 5.0, 0.2, 0.3], [0.4, 0.5, 0.0, 0.0]])
    rewards = A.outcome_rewards_BT(np.array([2.0, -1.0]), mask)
    adv, ret = A.gae_BT(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[1.9, 0, 1.8, 1.7], [-1.4, -1.5, 0, 0]])
    np.testing.assert_allclose(ret, [[2, 0, 2, 2], [-1, -1, 0, 0]])
