"""CISPO, SAPO and GMPO policy terms (core/policy_terms.py) against hand-worked numbers, naive loops,
closed-form gradients, padding and micro-batch invariance."""

import math

import pytest
import torch

from grouprl.core import LOSS_TYPES, policy_loss
from tests.core.test_policy_loss import ragged_batch

F64 = torch.float64


def one_token(ratio: float, adv: float, **kw):
    """Loss and d loss / d logp for one real token with ρ = ``ratio`` (old = 0, logp = log ρ)."""
    logp = torch.tensor([[math.log(ratio)]], dtype=F64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1, dtype=F64), torch.tensor([adv], dtype=F64),
                              torch.ones(1, 1, dtype=torch.bool), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


# ---------------------------------------------------------------- CISPO

def test_cispo_worked_numbers_keep_every_gradient():
    """ε_low = 1 (no lower bound), ε_high = 0.28. A = +1, ρ = 1.5: weight clip(1.5, 0, 1.28) = 1.28,
    ℓ = −1.28·1·log 1.5 = −0.518991, dℓ/dlogp = −1.28: the token still moves (the PPO clip would give
    it zero gradient). A = −1, ρ = 0.5: weight 0.5 (no lower bound), dℓ/dlogp = +0.5."""
    loss, grad, stats = one_token(1.5, 1.0, loss_type="cispo", eps_low=1.0, eps_high=0.28)
    assert loss == pytest.approx(-1.28 * math.log(1.5), abs=1e-12) and grad == pytest.approx(-1.28, abs=1e-12)
    assert stats["is_clip_frac"] == 1.0
    _, grad_clip, _ = one_token(1.5, 1.0, eps_low=0.2, eps_high=0.28)
    assert grad_clip == 0.0
    loss, grad, stats = one_token(0.5, -1.0, loss_type="cispo", eps_low=1.0, eps_high=0.28)
    assert grad == pytest.approx(0.5, abs=1e-12) and stats["is_clip_frac"] == 0.0
    # with a lower bound ε_low = 0.2 the weight is raised to 0.8
    assert one_token(0.5, -1.0, loss_type="cispo", eps_low=0.2, eps_high=0.28)[1] == pytest.approx(0.8, abs=1e-12)


def test_cispo_caps_at_one_plus_eps_high_as_the_paper_not_at_eps_high_as_trl():
    """MiniMax-M1: clip(ρ, 1−ε_low, 1+ε_high). TRL clamps at ε_high itself, so with ε_high = 0.28 a
    token with ρ = 1.1 would get weight 0.28 there; here it keeps 1.1 (below the cap 1.28), and
    ρ = 1.3 gets 1.28, not 0.28."""
    assert one_token(1.1, 1.0, loss_type="cispo", eps_low=1.0, eps_high=0.28)[1] == pytest.approx(-1.1, abs=1e-12)
    assert one_token(1.3, 1.0, loss_type="cispo", eps_low=1.0, eps_high=0.28)[1] == pytest.approx(-1.28, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_cispo_gradient_is_the_closed_form(seed, agg):
    """∂ℓ_{i,t}/∂logp_{i,t} = −clip(ρ, 1−ε_low, 1+ε_high)·A_i, divided by the aggregation's count."""
    logp, old, _, adv, mask = ragged_batch(seed, 6, 5, spread=0.5)
    logp.requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="cispo", eps_low=0.3, eps_high=0.2, agg=agg)
    loss.backward()
    w = torch.exp(logp.detach() - old).clamp(0.7, 1.2)
    per_token = -w * adv[:, None]
    denom = mask.sum() if agg == "token-mean" else mask.sum(-1, keepdim=True).clamp(min=1) * mask.shape[0]
    want = torch.where(mask, per_token / denom, 0.0)
    torch.testing.assert_close(logp.grad, want, rtol=1e-12, atol=1e-14)
    naive = sum(-w[i, j] * adv[i] * logp[i, j].detach() for i in range(6) for j in range(5) if mask[i, j])
    if agg == "token-mean":
        assert loss.item() == pytest.approx(float(naive) / int(mask.sum()), abs=1e-12)


# ---------------------------------------------------------------- SAPO

def test_sapo_worked_numbers():
    """f(ρ) = σ(τ(ρ−1))·4/τ, ℓ = −f·A, dℓ/dlogp = −4σ(1−σ)·ρ·A.
    ρ = 1: σ = ½, f = 2/τ, gradient −A (the plain policy gradient), any τ.
    A = +1, ρ = 1.5, τ_pos = 1: σ(0.5) = 0.6224593, ℓ = −2.4898373, grad = −4·0.6224593·0.3775407·1.5 = −1.4100223.
    A = −1, ρ = 1.5, τ_neg = 1.05: σ(0.525) = 0.6283162, ℓ = +0.6283162·4/1.05 = 2.3935855,
    grad = +4·0.6283162·0.3716838·1.5 = 1.4012097 (decays faster than with τ_pos)."""
    loss, grad, _ = one_token(1.0, 1.0, loss_type="sapo", sapo_tau_pos=1.0)
    assert loss == pytest.approx(-2.0, abs=1e-12) and grad == pytest.approx(-1.0, abs=1e-12)
    assert one_token(1.0, -1.0, loss_type="sapo", sapo_tau_neg=1.05)[1] == pytest.approx(1.0, abs=1e-12)
    loss, grad, _ = one_token(1.5, 1.0, loss_type="sapo")
    assert loss == pytest.approx(-2.4898373, abs=1e-7) and grad == pytest.approx(-1.4100223, abs=1e-7)
    loss, grad, _ = one_token(1.5, -1.0, loss_type="sapo")
    assert loss == pytest.approx(2.3935855, abs=1e-7) and grad == pytest.approx(1.4012097, abs=1e-7)


def test_sapo_gate_is_asymmetric_and_smooth():
    """With τ_neg > τ_pos the gradient weight 4σ(1−σ) of a negative-advantage token falls faster as ρ
    leaves 1; the weight is continuous in ρ (no jump at 1 ± ε like the clip)."""
    ratios = torch.linspace(0.2, 3.0, 57, dtype=F64)
    pos = torch.tensor([abs(one_token(float(r), 1.0, loss_type="sapo", sapo_tau_pos=1.0)[1]) for r in ratios])
    neg = torch.tensor([abs(one_token(float(r), -1.0, loss_type="sapo", sapo_tau_neg=3.0)[1]) for r in ratios])
    far = (ratios - 1).abs() > 0.3
    assert (neg[far] < pos[far]).all()
    assert (pos.diff().abs() < 0.1).all() and (neg.diff().abs() < 0.1).all()


def test_sapo_reports_no_clip_and_the_share_of_damped_tokens():
    """The gate clips nothing, so the clip fractions are 0 whatever ε (which the gate never reads);
    `sapo_damped_frac` counts tokens whose gradient weight 4σ(1−σ) < 1/2. τ = 1 (A > 0): that is
    τ(ρ − 1) > ln((1 + √½)/(1 − √½)) = 1.7627, ρ > 2.7627. Ratios 1, 1.5, 3 (A = +1) and 0.2 (A = −1,
    τ 1.05: weight 4σ(−0.84)(1 − σ(−0.84)) = 0.84): one of four is damped."""
    logp = torch.log(torch.tensor([[1.0, 1.5, 3.0, 0.2]], dtype=F64))
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=F64)
    for eps in (0.2, 0.05):
        _, stats = policy_loss(logp, torch.zeros_like(logp), adv, torch.ones(1, 4, dtype=torch.bool),
                               loss_type="sapo", eps_low=eps, eps_high=eps)
        assert stats["clip_frac"] == stats["clip_frac_low"] == stats["clip_frac_high"] == 0.0
        assert stats["sapo_damped_frac"] == 0.25


@pytest.mark.parametrize("seed", range(4))
def test_sapo_matches_naive_loop_and_closed_form_gradient(seed):
    logp, old, _, adv, mask = ragged_batch(seed, 5, 6, spread=0.6)
    logp.requires_grad_(True)
    tp, tn = 1.0, 1.7
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="sapo", sapo_tau_pos=tp, sapo_tau_neg=tn)
    loss.backward()
    seq_terms, want = [], torch.zeros_like(logp)
    for i in range(5):
        toks = [j for j in range(6) if mask[i, j]]
        tau = tp if adv[i] > 0 else tn
        terms = []
        for j in toks:
            rho = math.exp(float(logp.detach()[i, j] - old[i, j]))
            sig = 1 / (1 + math.exp(-tau * (rho - 1)))
            terms.append(-sig * 4 / tau * float(adv[i]))
            want[i, j] = -4 * sig * (1 - sig) * rho * float(adv[i]) / max(len(toks), 1) / 5
        seq_terms.append(sum(terms) / max(len(toks), 1))
    assert loss.item() == pytest.approx(sum(seq_terms) / 5, abs=1e-12)
    torch.testing.assert_close(logp.grad, want, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- GMPO

def gmpo_one(deltas, adv, **kw):
    """Loss, d loss / d logp and stats for one completion with token log-ratios ``deltas`` (old = 0)."""
    logp = torch.tensor([deltas], dtype=F64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros_like(logp), torch.tensor([adv], dtype=F64),
                              torch.ones_like(logp, dtype=torch.bool), loss_type="gmpo", **kw)
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), stats


def paper_gmpo(rhos, adv, eps_low, eps_high):
    """arXiv 2507.20673's objective for one completion, in ratio space as the paper writes it:
    sgn(A)·Π_t |min(ρ_t·A, clip(ρ_t, e^−ε_low, e^ε_high)·A)|^{1/|o|}."""
    prod = 1.0
    for rho in rhos:
        clipped = min(max(rho, math.exp(-eps_low)), math.exp(eps_high))
        prod *= abs(min(rho * adv, clipped * adv))
    return math.copysign(1.0, adv) * prod ** (1 / len(rhos))


def test_gmpo_worked_numbers_match_the_paper_formula():
    """ε = 0.4 (log space, the paper's (e^−0.4, e^0.4)). A = +1, δ = [0.6, −0.1, 0.2]: only increases
    are bounded, δ̃ = [0.4, −0.1, 0.2], s̃ = exp(0.5/3) = 1.1813604, ℓ = −1.1813604; the clipped token
    has no gradient, the others −A·s̃/3 = −0.3937868. In ratio space: ρ = [1.8221, 0.9048, 1.2214],
    min(ρ, 1.4918) = [1.4918, 0.9048, 1.2214], product e^0.5, cube root 1.1813604.
    A = −1, δ = [−0.6, 0.1, −0.2]: only decreases are bounded, δ̃ = [−0.4, 0.1, −0.2],
    s̃ = exp(−0.5/3) = 0.8464817, ℓ = +0.8464817, gradient [0, 0.2821606, 0.2821606]."""
    loss, grad, stats = gmpo_one([0.6, -0.1, 0.2], 1.0, eps_low=0.4, eps_high=0.4)
    assert loss == pytest.approx(-1.1813604, abs=1e-7)
    assert loss == pytest.approx(-paper_gmpo([math.exp(0.6), math.exp(-0.1), math.exp(0.2)], 1.0, 0.4, 0.4), abs=1e-12)
    assert grad == pytest.approx([0.0, -0.3937868, -0.3937868], abs=1e-7)
    assert (stats["clip_frac_high"], stats["clip_frac_low"], stats["clip_frac"]) == (pytest.approx(1 / 3), 0.0,
                                                                                     pytest.approx(1 / 3))
    loss, grad, stats = gmpo_one([-0.6, 0.1, -0.2], -1.0, eps_low=0.4, eps_high=0.4)
    assert loss == pytest.approx(0.8464817, abs=1e-7)
    assert loss == pytest.approx(-paper_gmpo([math.exp(-0.6), math.exp(0.1), math.exp(-0.2)], -1.0, 0.4, 0.4),
                                 abs=1e-12)
    assert grad == pytest.approx([0.0, 0.2821606, 0.2821606], abs=1e-7)
    assert (stats["clip_frac_low"], stats["clip_frac_high"]) == (pytest.approx(1 / 3), 0.0)
    # the other side of each sign is left alone: A = +1 with δ = −0.6 keeps its gradient, −s̃·1/1
    loss, grad, _ = gmpo_one([-0.6], 1.0, eps_low=0.4, eps_high=0.4)
    assert loss == pytest.approx(-math.exp(-0.6), abs=1e-12) and grad == pytest.approx([-math.exp(-0.6)], abs=1e-12)


def naive_gmpo(logp, old, adv, mask, *, eps_low, eps_high, agg):
    """One completion at a time, on scalar tensors (autograd follows), in the paper's ratio-space
    product form; the loss is −J_i averaged over completions (seq-mean-token-mean, the paper's 1/G Σ_i)
    or, for token-mean, weighted by each completion's tokens."""
    lo, hi = math.exp(-eps_low), math.exp(eps_high)
    terms, lengths = [], []
    for i in range(logp.shape[0]):
        toks = [j for j in range(logp.shape[1]) if mask[i, j]]
        lengths.append(len(toks))
        if not toks:
            terms.append(torch.tensor(0.0, dtype=F64))
            continue
        prod = torch.tensor(1.0, dtype=F64)
        for j in toks:
            rho = torch.exp(logp[i, j] - old[i, j])
            prod = prod * torch.abs(torch.minimum(rho * adv[i], torch.clamp(rho, lo, hi) * adv[i]))
        terms.append(torch.sign(adv[i]) * prod ** (1 / len(toks)))
    if agg == "seq-mean-token-mean":
        return -sum(terms) / len(terms)
    return -sum(n * j for n, j in zip(lengths, terms)) / sum(lengths)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gmpo_equals_a_naive_per_sequence_loop_values_and_gradients(seed, agg):
    """Asymmetric log-space bounds (ε_low 0.3, ε_high 0.5) and log-ratios spread 0.5: some tokens on
    each side are clipped."""
    logp, old, _, adv, mask = ragged_batch(seed, 7, 6, spread=0.5)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, old, adv, mask, loss_type="gmpo", eps_low=0.3, eps_high=0.5, agg=agg)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    want = naive_gmpo(y, old, adv, mask, eps_low=0.3, eps_high=0.5, agg=agg)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    delta = logp - old
    low = int(((delta < -0.3) & (adv[:, None] < 0) & mask).sum())
    high = int(((delta > 0.5) & (adv[:, None] > 0) & mask).sum())
    assert (stats["clip_frac_low"], stats["clip_frac_high"]) == (pytest.approx(low / int(mask.sum())),
                                                                 pytest.approx(high / int(mask.sum())))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_gmpo_gradient_is_the_closed_form(seed, per_token_adv):
    """∂ℓ/∂logp_{i,t} = −A_{i,t}·s̃_i·1[δ_{i,t} unclipped on A_{i,t}'s side] / (N·|o_i|) under
    seq-mean-token-mean, s̃_i = exp(mean_t δ̃); per-token advantages (process supervision) each pick
    their own side and weight their own token (the module's stated departure)."""
    logp, old, _, adv, mask = ragged_batch(seed, 6, 5, per_token_adv=per_token_adv, spread=0.5)
    logp.requires_grad_(True)
    policy_loss(logp, old, adv, mask, loss_type="gmpo", eps_low=0.2, eps_high=0.3)[0].backward()
    a = adv if per_token_adv else adv[:, None].expand(-1, 5)
    delta = logp.detach() - old
    clipped = torch.where(a >= 0, delta.clamp(max=0.3), delta.clamp(min=-0.2))
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(torch.where(mask, clipped, 0.0).sum(-1, keepdim=True) / count)
    free = torch.where(a >= 0, delta <= 0.3, delta >= -0.2)
    want = torch.where(mask & free, -a * s / (count * 6), 0.0)
    torch.testing.assert_close(logp.grad, want, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- every loss type

@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_on_policy_every_loss_type_has_the_reinforce_gradient(loss_type):
    """At ρ = 1 (μ = 1) clip, CISPO, SAPO and GMPO all give ∂ℓ/∂logp = −A / count."""
    logp, _, _, adv, mask = ragged_batch(7, 6, 5)
    logp.requires_grad_(True)
    policy_loss(logp, logp.detach(), adv, mask, loss_type=loss_type, agg="token-mean")[0].backward()
    torch.testing.assert_close(logp.grad, torch.where(mask, -adv[:, None] / mask.sum(), 0.0), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "gmpo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_padding_never_contributes_and_micro_batches_sum_to_the_batch(loss_type, agg):
    logp, old, ref, adv, mask = ragged_batch(3, 8, 6, spread=0.5)
    kw = dict(loss_type=loss_type, agg=agg, max_tokens=9, ref_logp=ref, beta=0.1, eps_low=0.2, eps_high=0.3)
    full_logp = logp.clone().requires_grad_(True)
    full, _ = policy_loss(full_logp, old, adv, mask, **kw)
    full.backward()
    # garbage in padding changes nothing
    bad = ~mask
    g_logp = torch.where(bad, torch.nan, logp).requires_grad_(True)
    garbage, _ = policy_loss(g_logp, torch.where(bad, torch.inf, old), adv, mask,
                             **{**kw, "ref_logp": torch.where(bad, -torch.inf, ref)})
    garbage.backward()
    assert garbage.item() == pytest.approx(full.item(), abs=1e-12)
    assert (g_logp.grad[bad] == 0).all()
    torch.testing.assert_close(g_logp.grad, full_logp.grad, rtol=0, atol=0)
    # two micro-batches with the whole batch's normaliser add up to the full loss and gradient
    normalizer = int(mask.sum()) if agg == "token-mean" else 8
    micro_logp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 8)):
        part, _ = policy_loss(micro_logp[rows], old[rows], adv[rows], mask[rows], **{**kw, "ref_logp": ref[rows]},
                              normalizer=normalizer)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kw, setting", [({"dual_clip": 3.0}, "dual_clip=3.0"), ({"delta": 4.0}, "delta=4.0"),
                                         ({"ratio_level": "sequence"}, "importance_sampling_level='sequence'")])
@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "gmpo"])
def test_clip_only_options_are_rejected_with_other_loss_types(kw, setting, loss_type):
    """The message names the setting as the config spells it (check_loss_settings)."""
    logp, old, _, adv, mask = ragged_batch(0, 2, 3)
    with pytest.raises(ValueError, match=f"{setting} with loss_type={loss_type}: it shapes the PPO clip, which "
                                         f"{loss_type} replaces"):
        policy_loss(logp, old, adv, mask, loss_type=loss_type, **kw)


def test_unknown_loss_type_and_bad_temperatures():
    logp, old, _, adv, mask = ragged_batch(0, 2, 3)
    with pytest.raises(ValueError, match="loss_type='ppo' is unknown"):
        policy_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="sapo_temperature_neg=0.0 must be positive"):
        policy_loss(logp, old, adv, mask, loss_type="sapo", sapo_tau_neg=0.0)
