"""GAE and the clipped value loss (core/gae.py) against hand-worked numbers, a naive loop and the formula."""

import pytest
import torch

from grouprl.core import ADVANTAGE_ESTIMATORS, AdvantageInputs, gae_advantages, outcome_token_rewards, value_loss


def test_hand_worked_gae():
    """One completion of 3 tokens, reward r = 1 on the last, V = (0.5, 0.2, 0.8), γ = 0.9, λ = 0.5
    (γλ = 0.45); V after the last token is 0.

        δ_2 = 1 + 0.9·0   − 0.8 = 0.2
        δ_1 = 0 + 0.9·0.8 − 0.2 = 0.52
        δ_0 = 0 + 0.9·0.2 − 0.5 = −0.32
        A_2 = 0.2
        A_1 = 0.52 + 0.45·0.2  = 0.61
        A_0 = −0.32 + 0.45·0.61 = −0.0455
        R   = A + V = (0.4545, 0.81, 1.0)

    A second row of 2 tokens (one pad), reward 0, V = (0.3, 0.1): δ_1 = −0.1, δ_0 = 0.09 − 0.3 = −0.21,
    A = (−0.21 + 0.45·(−0.1), −0.1) = (−0.255, −0.1), R = (0.045, 0.0); the pad gets 0."""
    values = torch.tensor([[0.5, 0.2, 0.8], [0.3, 0.1, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0]), mask)  # [2, 3]
    assert rewards.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.0455, 0.61, 0.2], [-0.255, -0.1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.4545, 0.81, 1.0], [0.045, 0.0, 0.0]]))


def test_lambda_one_is_the_monte_carlo_return_minus_the_value_and_lambda_zero_the_td_error():
    g = torch.Generator().manual_seed(1)
    values = torch.rand(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    rewards = outcome_token_rewards(torch.tensor([1.0, -0.5, 2.0]), mask)
    gamma = 0.8
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=1.0)
    mc = torch.tensor([1.0, -0.5, 2.0])[:, None] * gamma ** torch.arange(4, -1, -1.0)[None]  # γ^{L−1−t}·r
    torch.testing.assert_close(adv, mc - values)
    torch.testing.assert_close(ret, mc)
    adv0, _ = gae_advantages(rewards, values, mask, gamma=gamma, lam=0.0)
    next_v = torch.cat([values[:, 1:], torch.zeros(3, 1)], 1)
    torch.testing.assert_close(adv0, rewards.float() + gamma * next_v - values)


def _naive_gae(rewards, values, mask, gamma, lam):
    """Per row, the action tokens in order; the recursion over them from the last, in Python floats."""
    N, T = values.shape
    adv = [[0.0] * T for _ in range(N)]
    for i in range(N):
        steps = [t for t in range(T) if mask[i, t]]
        last_a, next_v = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last_a = delta + gamma * lam * last_a
            adv[i][t] = last_a
            next_v = float(values[i, t])
    return torch.tensor(adv)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_vectorised_gae_matches_a_naive_loop_with_context_tokens_and_padding(gamma, lam):
    g = torch.Generator().manual_seed(0)
    N, T = 6, 9
    values = torch.randn(N, T, generator=g)
    lengths = torch.tensor([9, 5, 1, 7, 3, 0])
    mask = torch.arange(T)[None] < lengths[:, None]  # right padding
    mask[0, 3:5] = False  # inserted context (a tool result) inside a completion: not steps
    mask[3, 2] = False
    rewards = torch.randn(N, T, generator=g) * mask  # dense per-token rewards too
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, 0.0), rtol=1e-5, atol=1e-6)
    assert adv.shape == (N, T) and (adv[~mask] == 0).all()


def test_the_outcome_reward_sits_on_the_last_action_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    r = outcome_token_rewards(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert r.tolist() == [[0, 0, 0, 2.0, 0], [0] * 5, [-1.0, 0, 0, 0, 0]]


def test_the_gae_estimator_whitens_over_the_batch_tokens_and_needs_values():
    g = torch.Generator().manual_seed(2)
    values = torch.randn(4, 6, generator=g)
    mask = torch.arange(6)[None] < torch.tensor([6, 4, 2, 5])[:, None]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    estimator = ADVANTAGE_ESTIMATORS.get("gae")
    inputs = AdvantageInputs(rewards, 2, values=values, token_mask=mask, gamma=0.95, lam=0.9)
    raw, _ = gae_advantages(outcome_token_rewards(rewards, mask), values, mask, gamma=0.95, lam=0.9)
    torch.testing.assert_close(estimator(inputs, scale="none", eps=1e-4, unbiased=True), raw)
    white = estimator(inputs, scale="batch", eps=0.0, unbiased=True)
    real = raw[mask].double()
    torch.testing.assert_close(white[mask].double(), (real - real.mean()) / real.std(), rtol=1e-5, atol=1e-6)
    assert (white[~mask] == 0).all()
    with pytest.raises(ValueError, match="scale 'batch'"):
        estimator(inputs, scale="group", eps=1e-4, unbiased=True)
    with pytest.raises(ValueError, match="value_head: true"):
        estimator(AdvantageInputs(rewards, 2), scale="none", eps=1e-4, unbiased=True)


def test_clipped_value_loss_matches_its_formula_and_its_gradient():
    """ℓ = ½·max((v − R)², (v_old + clip(v − v_old, −c, c) − R)²), token-mean: value and autograd
    gradient against the formula written out token by token."""
    c = 0.2
    v = torch.tensor([[0.5, 1.0, -0.3], [0.0, 0.9, 4.0]], requires_grad=True)
    old = torch.tensor([[0.1, 1.1, -0.2], [0.0, 0.2, 0.0]])
    ret = torch.tensor([[1.0, 0.0, -0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, stats = value_loss(v, old, ret, mask, cliprange_value=c, agg="token-mean")
    # token by token: (v, old, R) -> unclipped, clipped, max, d/dv (only the larger term's v has a gradient,
    # and the clipped term's only when v − old lies inside [−c, c])
    #   (0.5, 0.1, 1.0):  v−old = 0.4 → v_clip = 0.3; (−0.5)² = .25, (−0.7)² = .49 → clipped wins, grad 0
    #   (1.0, 1.1, 0.0):  −0.1 inside;  1.0, 1.0 → equal; max takes the first: grad (v−R) = 1.0
    #   (−0.3, −0.2, −0.3): −0.1 inside; 0, 0 → grad 0
    #   (0.0, 0.0, 0.5):  0 inside; .25, .25 → grad (v−R) = −0.5
    #   (0.9, 0.2, 0.0):  0.7 → v_clip = 0.4; .81 vs .16 → unclipped wins, grad 0.9
    per_token = [0.5 * 0.49, 0.5 * 1.0, 0.0, 0.5 * 0.25, 0.5 * 0.81]
    torch.testing.assert_close(loss, torch.tensor(sum(per_token) / 5))
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 1.0, 0.0], [-0.5, 0.9, 0.0]]) / 5)
    assert stats["value_clip_frac"] == pytest.approx(1 / 5)
    assert stats["value_loss"] == pytest.approx(sum(per_token) / 5)


def test_value_loss_without_clipping_is_half_the_squared_error_and_aggregates_like_the_policy_loss():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 4, generator=g)
    ret = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    loss, _ = value_loss(v, v + 5.0, ret, mask, cliprange_value=None, agg="seq-mean-token-mean")
    sq = 0.5 * (v - ret).square() * mask
    torch.testing.assert_close(loss, (sq.sum(1) / mask.sum(1)).mean())
    loss, _ = value_loss(v, v, ret, mask, cliprange_value=None, agg="token-mean", normalizer=20)
    torch.testing.assert_close(loss, sq.sum() / 20)


def test_bad_arguments_fail_clearly():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="gamma=1.5"):
        gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), mask, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match="finite"):
        gae_advantages(torch.zeros(1, 2), torch.tensor([[0.0, float("nan")]]), mask, gamma=1.0, lam=0.9)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), mask, cliprange_value=0.0,
                   agg="token-mean")
