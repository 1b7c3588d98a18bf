"""KL estimators against docs/algorithms.md worked numbers and their closed forms."""

import math

import pytest
import torch

from grouprl.core import KL_ESTIMATORS, kl_estimate


def test_worked_k3_numbers():
    """π = 0.5, π_ref = 0.25: π_ref/π − log(π_ref/π) − 1 = 0.5 + log 2 − 1 = 0.193147;
    π = 0.25, π_ref = 0.5: 2 − log 2 − 1 = 0.306853."""
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)
    got = kl_estimate(logp, ref, "k3")
    assert got.tolist() == pytest.approx([0.193147, 0.306853], abs=5e-7)
    assert got.tolist() == pytest.approx([math.log(2) - 0.5, 1 - math.log(2)], rel=1e-14)


def test_estimators_closed_forms_and_shapes():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 4
    d = logp - ref
    ratio = torch.exp(ref - logp)  # π_ref / π
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), d, rtol=0, atol=0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), 0.5 * d**2, rtol=1e-15, atol=0)
    torch.testing.assert_close(kl_estimate(logp, ref), ratio - torch.log(ratio) - 1, rtol=1e-12, atol=1e-15)
    assert kl_estimate(logp, ref).shape == (4, 6)
    assert (kl_estimate(logp, ref) >= 0).all() and (kl_estimate(logp, logp) == 0).all()
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]


def test_k3_accurate_for_tiny_delta():
    """expm1(−δ) + δ in float32 errs by about eps32·|δ|; exp(−δ) + δ − 1 would err by about eps32
    (for δ = 1e-3 that is 6e-8, a tenth of k3 ≈ δ²/2 = 5e-7)."""
    d = torch.tensor([1e-3, -1e-4, 3e-5], dtype=torch.float32)
    got = kl_estimate(d, torch.zeros_like(d), "k3").double()
    dd = d.double()
    want = torch.expm1(-dd) + dd
    assert ((got - want).abs() <= 1.2e-7 * dd.abs()).all()


def test_gradient_of_k3():
    """∂k3/∂logp = 1 − exp(−δ) = 1 − π_ref/π."""
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.5], dtype=torch.float64)
    kl_estimate(logp, ref).sum().backward()
    torch.testing.assert_close(logp.grad, 1 - torch.exp(ref - logp.detach()))


def test_bad_input():
    with pytest.raises(ValueError, match="kind='k4' is unknown"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="ref_logp has"):
        kl_estimate(torch.zeros(2, 3), torch.zeros(2, 4))


def test_each_estimators_expected_gradient_in_the_loss():
    """What a KL estimator does in the loss is its gradient on the policy's own samples, in expectation
    (summed over a 3-token vocabulary, the sampling weights held fixed): k1's is zero, k2's is the
    reverse KL's, k3's the forward KL's (docs/algorithms.md, section 5)."""
    from grouprl.core.kl import kl_estimate

    pi, ref = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)

    def grad(loss_of_logp):
        z = pi.log().clone().requires_grad_()
        loss_of_logp(torch.log_softmax(z, 0)).backward()
        return z.grad

    def expected(name):
        return grad(lambda logp: (pi * kl_estimate(logp, ref.log(), name)).sum())

    assert torch.equal(expected("k1"), torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(expected("k2"), grad(lambda logp: (logp.exp() * (logp - ref.log())).sum()))
    torch.testing.assert_close(expected("k3"), grad(lambda logp: (ref * (ref.log() - logp)).sum()))
