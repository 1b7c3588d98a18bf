"""On-policy distillation's signal and advantage mix (core/distillation.py) against reference math:
a hand-worked case, a naive loop against the vectorised code, and the gradient the policy loss
takes from these advantages against the gradient of the reverse KL it estimates."""

import math

import pytest
import torch

from grouprl.core import DISTILL_SIGNALS, distill_advantages, distill_stats, policy_loss, reverse_kl_signal


def test_hand_worked_signal_mix_and_stats():
    """Two completions of 3 tokens, the second one token shorter (padding holds garbage).
    Teacher/student probabilities of the sampled tokens:
      row 0: (0.5, 0.25), (0.25, 0.5), (0.8, 0.8)  ->  d = log 2, −log 2, 0
      row 1: (0.1, 0.4), (0.9, 0.3), padding        ->  d = log 0.25, log 3, 0
    Verifier advantages A^R = [1.5, −0.5] (given). With c_R = 1, λ = 0.5:
      row 0: 1.5 + 0.5·(0.693147, −0.693147, 0) = (1.846574, 1.153426, 1.5)
      row 1: −0.5 + 0.5·(−1.386294, 1.098612) = (−1.193147, 0.049306), padding 0.
    Stats over the 5 real tokens: teacher mean log-prob (log .5 + log .25 + log .8 + log .1 + log .9)/5,
    student (log .25 + log .5 + log .8 + log .4 + log .3)/5, reverse_kl = student − teacher."""
    t = torch.tensor([[0.5, 0.25, 0.8], [0.1, 0.9, 1.0]]).log()
    s = torch.tensor([[0.25, 0.5, 0.8], [0.4, 0.3, 1.0]]).log()
    t[1, 2], s[1, 2] = float("nan"), float("-inf")  # padding: must not leak
    mask = torch.tensor([[True, True, True], [True, True, False]])
    d = reverse_kl_signal(t, s, mask)
    ln2 = math.log(2)
    torch.testing.assert_close(d, torch.tensor([[ln2, -ln2, 0.0], [math.log(0.25), math.log(3), 0.0]]))
    adv = distill_advantages(torch.tensor([1.5, -0.5]), d, mask, coef=0.5, reward_coef=1.0)
    want = torch.tensor([[1.846574, 1.153426, 1.5], [-1.193147, 0.049306, 0.0]])
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    alone = distill_advantages(torch.tensor([1.5, -0.5]), d, mask, coef=1.0, reward_coef=0.0)
    torch.testing.assert_close(alone, d)  # distillation alone: the signal itself
    stats = distill_stats(t, s, mask)
    teacher = (math.log(0.5) + math.log(0.25) + math.log(0.8) + math.log(0.1) + math.log(0.9)) / 5
    student = (math.log(0.25) + math.log(0.5) + math.log(0.8) + math.log(0.4) + math.log(0.3)) / 5
    assert stats["teacher_logp"] == pytest.approx(teacher, abs=1e-6)
    assert stats["student_logp"] == pytest.approx(student, abs=1e-6)
    assert stats["reverse_kl"] == pytest.approx(student - teacher, abs=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_naive_loop_matches_the_vectorised_mix(per_token):
    g = torch.Generator().manual_seed(0)
    N, T = 6, 7
    t, s = -3 * torch.rand(N, T, generator=g), -3 * torch.rand(N, T, generator=g)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]  # [N, T]
    adv_r = torch.randn(N, T, generator=g) if per_token else torch.randn(N, generator=g)
    coef, reward_coef = 0.7, 1.3
    got = distill_advantages(adv_r, DISTILL_SIGNALS.get("reverse_kl")(t, s, mask), mask, coef=coef,
                             reward_coef=reward_coef)
    want = torch.zeros(N, T)
    for i in range(N):
        for j in range(T):
            if mask[i, j]:
                a = float(adv_r[i, j]) if per_token else float(adv_r[i])
                want[i, j] = reward_coef * a + coef * (float(t[i, j]) - float(s[i, j]))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.shape == (N, T) and got.dtype == torch.float32


def test_the_loss_gradient_is_the_reverse_kl_gradient_in_expectation():
    """One-token completions from a categorical student π_S = softmax(θ) over V = 5 tokens. At one update
    per rollout the policy loss with advantage d(y) = log π_T(y) − log π_S(y) has the gradient
    −d(y)·∇log π_S(y) for a sampled y; weighting each y by π_S(y) (the exact expectation, every token
    enumerated) gives E[−d·∇log π_S] = ∇_θ KL(π_S‖π_T), the gradient of the reverse KL (the score-function
    identity, since E[∇log π_S] = 0). Checked against autograd through the KL's own formula."""
    g = torch.Generator().manual_seed(1)
    V = 5
    theta = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)  # [V]
    student = torch.log_softmax(theta, -1)  # [V]
    kl = (student.exp() * (student - teacher)).sum()
    (want,) = torch.autograd.grad(kl, theta, retain_graph=True)  # `student` is used again below

    logp = student[:, None]  # [V, 1]: completion y = each token once
    mask = torch.ones(V, 1, dtype=torch.bool)
    adv = distill_advantages(torch.zeros(V), reverse_kl_signal(teacher[:, None], logp.detach(), mask), mask)
    weights = student.exp().detach()[:, None]  # [V, 1] π_S(y): the expectation over the sample
    loss, _ = policy_loss(logp, logp.detach(), adv.double(), mask, agg="token-mean", token_weights=weights,
                          normalizer=1.0)
    (got,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_an_agreeing_teacher_gives_zero_signal_and_leaves_the_reward_advantages():
    logp = -torch.rand(4, 3)
    mask = torch.ones(4, 3, dtype=torch.bool)
    d = reverse_kl_signal(logp, logp.clone(), mask)
    assert (d == 0).all()
    adv_r = torch.tensor([1.0, -1.0, 0.5, -0.5])
    torch.testing.assert_close(distill_advantages(adv_r, d, mask, coef=2.0, reward_coef=1.0),
                               adv_r[:, None].expand(4, 3))


def test_bad_inputs_say_what_is_wrong():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"teacher_logp has shape \(2, 2\), expected \(2, 3\)"):
        reverse_kl_signal(torch.zeros(2, 2), torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\)"):
        distill_advantages(torch.zeros(3), torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match="coef=-1.0 must be a number >= 0"):
        distill_advantages(torch.zeros(2), torch.zeros(2, 3), mask, coef=-1.0)
    assert "reverse_kl" in DISTILL_SIGNALS
