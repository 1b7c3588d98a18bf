"""policy_loss (core/policy_loss.py) against worked numbers, naive loops and invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.core import LossParams, policy_loss, token_logprobs

AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
L_MAX = 9  # max_tokens for seq-mean-token-sum-norm in random batches (≥ T)


def ragged_batch(seed, n, t, *, per_token_adv=False, spread=0.4):
    """Random float64 batch with ragged right padding (lengths 0..T, at least one real token)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [N, T]
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3  # [N, T]
    old = logp + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    shape = (n, t) if per_token_adv else (n,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


# ---------------------------------------------------------------- worked numbers (docs/algorithms.md)

@pytest.mark.parametrize("adv, want_loss, want_grad, clip_high", [(1.0, -1.2, 0.0, 1.0), (-1.0, 1.5, 1.5, 0.0)])
def test_worked_clip_examples(adv, want_loss, want_grad, clip_high):
    """ε = 0.2, ρ = 1.5. A = +1: min(1.5, 1.2) = 1.2, the clipped branch, zero gradient.
    A = −1: min(−1.5, −1.2) = −1.5, the unclipped branch, d(−ρA)/dlogp = ρ = 1.5."""
    logp = torch.tensor([[math.log(1.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, stats = policy_loss(logp, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert logp.grad.item() == pytest.approx(want_grad, abs=1e-12)
    assert stats["clip_frac_high"] == clip_high and stats["clip_frac_low"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.5, abs=1e-12)


# ---------------------------------------------------------------- naive reference

def naive_policy_loss(logp, old, adv, mask, *, eps_low, eps_high, ratio_level, agg, ref, beta, kl_kind,
                      dual_clip, delta, max_tokens):
    """Token-by-token loops on scalar tensors (autograd follows), written straight from docs/algorithms.md."""
    n, t = logp.shape
    lengths = [int(mask[i].sum()) for i in range(n)]
    per_seq, stats = [], dict(low=0, high=0, dual=0, ratio=0.0, approx_kl=0.0, kl=0.0)
    for i in range(n):
        toks = [j for j in range(t) if mask[i, j]]
        if ratio_level == "sequence":
            s_i = torch.exp(sum((logp[i, j] - old[i, j] for j in toks), torch.tensor(0.0)) / max(len(toks), 1))
        losses = []
        for j in toks:
            a = adv[i, j] if adv.dim() == 2 else adv[i]
            if ratio_level == "token":
                rho = torch.exp(logp[i, j] - old[i, j])
            else:
                rho = s_i.detach() * torch.exp(logp[i, j] - logp[i, j].detach())
            unclipped = -a * (rho if delta is None else torch.clamp(rho, max=delta))
            clipped = -a * torch.clamp(rho, 1 - eps_low, 1 + eps_high)
            ell = unclipped if unclipped >= clipped else clipped
            if dual_clip is not None and a < 0 and ell > -dual_clip * a:
                ell = -dual_clip * a
                stats["dual"] += 1
            d = logp[i, j] - ref[i, j]
            kl = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[kl_kind]
            if beta > 0:
                ell = ell + beta * kl
            losses.append(ell)
            stats["low"] += bool(rho < 1 - eps_low and a < 0)
            stats["high"] += bool(rho > 1 + eps_high and a > 0)
            stats["ratio"] += rho.item()
            r = math.exp(logp[i, j].item() - old[i, j].item())
            stats["approx_kl"] += (r - 1) - math.log(r)
            stats["kl"] += kl.item()
        per_seq.append(losses)
    total = sum((x for seq in per_seq for x in seq), torch.tensor(0.0))
    if agg == "token-mean":
        loss = total / sum(lengths)
    elif agg == "seq-mean-token-mean":
        loss = sum((sum(seq, torch.tensor(0.0)) / max(len(seq), 1) for seq in per_seq), torch.tensor(0.0)) / n
    elif agg == "seq-mean-token-sum":
        loss = total / n
    else:
        loss = total / (n * max_tokens)
    count = sum(lengths)
    return loss, {"clip_frac_low": stats["low"] / count, "clip_frac_high": stats["high"] / count,
                  "clip_frac": (stats["low"] + stats["high"]) / count, "ratio_mean": stats["ratio"] / count,
                  "approx_kl": stats["approx_kl"] / count, "kl": stats["kl"] / count,
                  "dual_clip_frac": stats["dual"] / count, "num_tokens": float(count)}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5), t=st.integers(1, 6), agg=st.sampled_from(AGGS),
       ratio_level=st.sampled_from(["token", "sequence"]), per_token_adv=st.booleans(),
       eps=st.sampled_from([(0.2, None), (0.2, 0.28), (0.1, 0.05)]), dual_clip=st.sampled_from([None, 3.0]),
       delta=st.sampled_from([None, 1.3]), beta=st.sampled_from([0.0, 0.04]),
       kl_kind=st.sampled_from(["k1", "k2", "k3"]))
def test_policy_loss_matches_naive_loops(seed, n, t, agg, ratio_level, per_token_adv, eps, dual_clip, delta,
                                          beta, kl_kind):
    logp, old, ref, adv, mask = ragged_batch(seed, n, t, per_token_adv=per_token_adv, spread=0.6)
    eps_low, eps_high = eps
    kw = dict(eps_low=eps_low, ratio_level=ratio_level, agg=agg, beta=beta, kl_kind=kl_kind,
              dual_clip=dual_clip, delta=delta, max_tokens=L_MAX)
    x = logp.clone().requires_grad_()
    loss, stats = policy_loss(x, old, adv, mask, eps_high=eps_high, ref_logp=ref, **kw)
    loss.backward()
    y = logp.clone().requires_grad_()
    want, want_stats = naive_policy_loss(y, old, adv, mask, eps_high=eps_low if eps_high is None else eps_high,
                                         ref=ref, **kw)
    if want.requires_grad:  # not when every token is dual-clipped to the constant −c·A
        want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(x.grad, torch.zeros_like(logp) if y.grad is None else y.grad, rtol=1e-10, atol=1e-12)
    expected_keys = set(want_stats) - ({"dual_clip_frac"} if dual_clip is None else set())
    assert set(stats) == expected_keys
    for key in expected_keys:
        assert stats[key] == pytest.approx(want_stats[key], rel=1e-9, abs=1e-12), key


# ---------------------------------------------------------------- gradients vs closed forms

def agg_weights(mask, agg):
    """∂loss/∂ℓ_{i,t} of each aggregation mode, as a [N, T] tensor."""
    m = mask.double()
    n = m.shape[0]
    return {"token-mean": m / m.sum(), "seq-mean-token-mean": m / (n * m.sum(1, keepdim=True).clamp(min=1)),
            "seq-mean-token-sum": m / n, "seq-mean-token-sum-norm": m / (n * L_MAX)}[agg]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_on_policy_gradient_is_reinforce(agg, ratio_level, per_token_adv):
    """At ρ = 1 (old = sg[logp], μ = 1) clipping is inactive: ∂loss/∂logp_{i,t} = −A_{i,t}·w_{i,t}."""
    logp, _, _, adv, mask = ragged_batch(7, 6, 5, per_token_adv=per_token_adv)
    x = logp.clone().requires_grad_()
    loss, stats = policy_loss(x, x.detach(), adv, mask, ratio_level=ratio_level, agg=agg, max_tokens=L_MAX)
    loss.backward()
    a = adv if per_token_adv else adv[:, None].expand_as(logp)
    torch.testing.assert_close(x.grad, -a * agg_weights(mask, agg), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss, (-a * agg_weights(mask, agg)).sum(), rtol=1e-12, atol=1e-15)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-15) and stats["clip_frac"] == 0.0
    assert stats["approx_kl"] == 0.0


def test_clipped_tokens_get_zero_gradient():
    """ε = 0.2: ρ = 1.5 with A > 0 and ρ = 0.5 with A < 0 are clipped (zero grad); the other two
    tokens are not (ρ = 1.5, A < 0; ρ = 0.5, A > 0) and get −A·ρ·w with token-mean w = 1/4."""
    rho = torch.tensor([[1.5, 0.5, 1.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    x = rho.log().requires_grad_()
    loss, stats = policy_loss(x, torch.zeros_like(rho), adv, torch.ones_like(rho), agg="token-mean")
    loss.backward()
    assert x.grad.tolist() == [[0.0, 0.0, 1.5 / 4, -0.5 / 4]]
    assert stats["clip_frac_high"] == 0.25 and stats["clip_frac_low"] == 0.25 and stats["clip_frac"] == 0.5


def test_dual_clip_and_delta_caps():
    """A = −1, ρ = 5: plain loss 5; dual clip c = 3 caps it at 3 (zero grad); δ = 4 caps the unclipped
    term at 4 (zero grad). A = +1, ρ = 5 with δ = 4: clipped branch, loss −1.2."""
    x = torch.tensor([[math.log(5.0)] * 2], dtype=torch.float64, requires_grad=True)
    old, mask = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    for kw, want in [({}, (5.0 - 1.2) / 2), ({"dual_clip": 3.0}, (3.0 - 1.2) / 2), ({"delta": 4.0}, (4.0 - 1.2) / 2)]:
        x.grad = None
        loss, stats = policy_loss(x, old, adv, mask, agg="token-mean", **kw)
        loss.backward()
        assert loss.item() == pytest.approx(want, abs=1e-12)
        assert x.grad[0, 1].item() == 0.0
        assert x.grad[0, 0].item() == pytest.approx(0.0 if kw else 2.5, abs=1e-12)
    assert stats["clip_frac_high"] == 0.5
    assert policy_loss(x, old, adv, mask, dual_clip=3.0)[1]["dual_clip_frac"] == 0.5


def test_sequence_ratio_gradient_is_gspo():
    """Per-sequence A with seq-mean-token-mean: GSPO-token gradient = the sequence-level GSPO gradient
    ∂/∂logp_t of −min(s·A, clip(s)·A), s = exp(mean_t(logp − old))."""
    logp, old, _, adv, mask = ragged_batch(3, 5, 6, spread=0.002)
    x = logp.clone().requires_grad_()
    loss, _ = policy_loss(x, old, adv, mask, ratio_level="sequence", eps_low=3e-4, eps_high=4e-4)
    loss.backward()
    y = logp.clone().requires_grad_()
    m = mask.double()
    s = torch.exp(((y - old) * m).sum(1) / m.sum(1).clamp(min=1))  # [N]
    per_seq = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-4, 1 + 4e-4))  # [N]
    want = torch.where(mask.any(1), per_seq, 0.0).mean()  # an empty sequence contributes 0
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-15)
    assert (x.grad == 0).any() and (x.grad != 0).any()  # some sequences clipped, some not


# ---------------------------------------------------------------- invariants

@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("float_mask", [False, True])
def test_padding_never_contributes(agg, ratio_level, float_mask):
    logp, old, ref, adv, mask = ragged_batch(11, 6, 7, per_token_adv=True)
    pad = ~mask
    assert pad.any(1).sum() >= 3
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])
    fill = garbage[torch.arange(int(pad.sum())) % 5].double()

    def dirty(x):
        x = x.clone()
        x[pad] = fill
        return x

    kw = dict(ratio_level=ratio_level, agg=agg, max_tokens=L_MAX, beta=0.1, dual_clip=3.0, delta=2.0)
    m = mask.double() if float_mask else mask
    weights = 0.5 + torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    results = []
    for args in [(logp, old, ref, adv, weights), tuple(dirty(v) for v in (logp, old, ref, adv, weights))]:
        x = args[0].clone().requires_grad_()
        loss, stats = policy_loss(x, args[1], args[3], m, ref_logp=args[2], token_weights=args[4], **kw)
        loss.backward()
        results.append((loss, stats, x.grad))
    (loss0, stats0, grad0), (loss1, stats1, grad1) = results
    assert torch.isfinite(loss0) and loss0.item() == loss1.item()
    assert stats0 == stats1
    assert torch.equal(grad0, grad1) and (grad1[pad] == 0).all()


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batches_and_ranks_sum_to_full_batch(agg, ratio_level):
    """Gradient accumulation and data parallelism: each piece divides by the whole optimizer batch's
    count (tokens for token-mean, sequences otherwise); the pieces' losses and gradients add up."""
    logp, old, ref, adv, mask = ragged_batch(5, 8, 6, spread=0.3)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    kw = dict(ratio_level=ratio_level, agg=agg, max_tokens=L_MAX, ref_logp=ref, beta=0.04)
    x = logp.clone().requires_grad_()
    full, _ = policy_loss(x, old, adv, mask, **{**kw, "ref_logp": ref}, token_weights=weights)
    full.backward()
    normalizer = int(mask.sum()) if agg == "token-mean" else logp.shape[0]
    y = logp.clone().requires_grad_()
    total = 0.0
    for rank in (torch.arange(0, 8, 2), torch.arange(1, 8, 2)):  # interleaved "ranks"
        for micro in (rank[:1], rank[1:]):  # uneven micro-batches
            loss, _ = policy_loss(y[micro], old[micro], adv[micro], mask[micro], **{**kw, "ref_logp": ref[micro]},
                                  normalizer=normalizer, token_weights=weights[micro])
            loss.backward()
            total += loss.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("agg", AGGS)
def test_token_weights_scale_the_clipped_term_only(agg):
    """Each token's loss depends on its own logp only, so per token ∂L/∂logp = w·g_pg + g_kl, with
    g_pg the gradient without weights and β = 0, and g_kl the gradient of the KL term alone
    (A = 0 makes the clipped term 0). No gradient reaches the weights; w = 1 changes nothing."""
    logp, old, ref, adv, mask = ragged_batch(6, 5, 6, spread=0.3)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
    kw = dict(agg=agg, max_tokens=L_MAX, ref_logp=ref, dual_clip=3.0)

    def grad(advantages, beta, token_weights=None):
        x = logp.clone().requires_grad_()
        loss, _ = policy_loss(x, old, advantages, mask, beta=beta, token_weights=token_weights, **kw)
        loss.backward()
        return loss, x.grad

    loss_pg, g_pg = grad(adv, 0.0)
    _, g_kl = grad(torch.zeros_like(adv), 0.1)
    _, g = grad(adv, 0.1, w)
    assert (g_pg[mask] != 0).float().mean() > 0.5 and (g_kl[mask] != 0).all()
    torch.testing.assert_close(g, w.detach() * g_pg + g_kl, rtol=1e-12, atol=1e-15)
    assert w.grad is None
    loss_one, g_one = grad(adv, 0.0, torch.ones_like(logp))
    assert loss_one.item() == loss_pg.item() and torch.equal(g_one, g_pg)


def test_tensor_normalizer_and_stats_num_tokens():
    logp, old, _, adv, mask = ragged_batch(2, 4, 5)
    a, _ = policy_loss(logp, old, adv, mask, agg="token-mean", normalizer=torch.tensor(20.0))
    b, stats = policy_loss(logp, old, adv, mask, agg="token-mean")
    assert a.item() == pytest.approx(b.item() * mask.sum().item() / 20, rel=1e-12)
    assert stats["num_tokens"] == float(mask.sum())
    assert all(isinstance(v, float) for v in stats.values())


# ---------------------------------------------------------------- entropy bonus

def naive_aggregate(values, mask, agg, max_tokens=L_MAX):
    """Σ over real tokens with the aggregation's weights, one token at a time (docs/algorithms.md §7)."""
    n, t = mask.shape
    lengths = [int(mask[i].sum()) for i in range(n)]
    total = 0.0
    for i in range(n):
        for j in range(t):
            if not mask[i, j]:
                continue
            weight = {"token-mean": 1 / sum(lengths), "seq-mean-token-mean": 1 / (n * lengths[i]),
                      "seq-mean-token-sum": 1 / n, "seq-mean-token-sum-norm": 1 / (n * max_tokens)}[agg]
            total += weight * float(values[i, j])
    return total


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss_type", ["clip", "gmpo"])
def test_entropy_bonus_is_minus_c_times_the_aggregated_entropy(agg, loss_type):
    """loss(c) = loss(0) − c·agg(H) with agg the loss's own aggregation (a naive loop), whatever the token
    weights (the bonus is not weighted, like the KL term); ∂loss/∂H = −c·(the aggregation's weight of the
    token); garbage entropies in padding change nothing; c = 0 ignores the entropy entirely."""
    logp, old, ref, adv, mask = ragged_batch(4, 6, 5, spread=0.3)
    g = torch.Generator().manual_seed(5)
    ent = (torch.rand(logp.shape, generator=g, dtype=torch.float64) * 2)
    ent = torch.where(mask, ent, torch.nan).requires_grad_(True)  # [N, T], NaN on padding
    weights = torch.rand(logp.shape, generator=g, dtype=torch.float64)
    kw = dict(agg=agg, max_tokens=L_MAX, ref_logp=ref, beta=0.05, token_weights=weights, loss_type=loss_type)
    base, stats0 = policy_loss(logp, old, adv, mask, **kw)
    assert "entropy_bonus" not in stats0
    c = 0.03
    loss, stats = policy_loss(logp, old, adv, mask, entropy=ent, entropy_coef=c, **kw)
    loss.backward()
    assert loss.item() == pytest.approx(base.item() - c * naive_aggregate(ent.detach(), mask, agg), abs=1e-12)
    one_hot_sums = torch.stack([torch.tensor(naive_aggregate(torch.eye(ent.numel(), dtype=torch.float64)[k]
                                                             .view(ent.shape), mask, agg), dtype=torch.float64)
                                for k in range(ent.numel())]).view(ent.shape)  # each token's weight
    torch.testing.assert_close(ent.grad, -c * one_hot_sums, rtol=1e-12, atol=1e-15)
    real = torch.where(mask, ent.detach(), 0.0)
    assert stats["entropy_bonus"] == pytest.approx(c * float(real.sum()) / int(mask.sum()), abs=1e-12)
    unchanged, _ = policy_loss(logp, old, adv, mask, entropy=ent, entropy_coef=0.0, **kw)
    assert unchanged.item() == base.item()


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_bonus_gradient_wrt_logits_is_the_formula(agg, temperature):
    """End to end from logits, on-policy (old = sg[logp], ρ = 1): with w_{i,t} the aggregation's weight
    of a real token, ∂L/∂z = w·(−A·(1[v = y] − p) + c·p·(log p + H))/τ, i.e. the policy gradient plus
    −c·w·∂H/∂z with ∂H/∂z = −p·(log p + H)/τ; 0 on padding. At c = 0 the gradient is the first term
    alone, bit for bit the one without any entropy."""
    from grouprl.core import token_logprobs_and_entropy

    n, t, v, c = 4, 5, 7, 0.2
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(n, t, v, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, v, (n, t), generator=g)
    mask = torch.arange(t)[None] < torch.tensor([5, 3, 1, 4])[:, None]  # [N, T]
    adv = torch.randn(n, generator=g, dtype=torch.float64)

    def grad(coef):
        z = logits.clone().requires_grad_(True)
        logp, ent = token_logprobs_and_entropy(z, tokens, temperature=temperature, entropy_grad=coef > 0)
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg=agg, entropy=ent, entropy_coef=coef)
        loss.backward()
        return z.grad

    logp_all = torch.log_softmax(logits / temperature, -1)  # [N, T, V]
    p = logp_all.exp()
    h = -(p * logp_all).sum(-1, keepdim=True)  # [N, T, 1]
    onehot = torch.nn.functional.one_hot(tokens, v).double()
    lengths = mask.sum(-1, keepdim=True).double()  # [N, 1]
    w = (1 / (n * lengths) if agg == "seq-mean-token-mean" else torch.full_like(lengths, 1 / mask.sum().item()))
    w = torch.where(mask, w, 0.0)[..., None]  # [N, T, 1]
    pg = w * (-adv[:, None, None] * (onehot - p)) / temperature
    bonus = w * c * p * (logp_all + h) / temperature
    torch.testing.assert_close(grad(c), pg + bonus, rtol=1e-10, atol=1e-14)
    z0 = logits.clone().requires_grad_(True)
    plain = token_logprobs(z0, tokens, temperature=temperature)
    policy_loss(plain, plain.detach(), adv, mask, agg=agg)[0].backward()
    assert torch.equal(grad(0.0), z0.grad)
    torch.testing.assert_close(z0.grad, pg, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- bad input

def _args(n=2, t=3):
    return torch.zeros(n, t), torch.zeros(n, t), torch.zeros(n), torch.ones(n, t, dtype=torch.bool)


@pytest.mark.parametrize("change, match", [
    (dict(old_logp=torch.zeros(2, 4)), "old_logp has shape"),
    (dict(advantages=torch.zeros(3)), "advantages has shape"),
    (dict(mask=torch.ones(2, 2)), "mask has shape"),
    (dict(logp=torch.zeros(6)), r"logp must be a \[N, T\]"),
    (dict(ref_logp=torch.zeros(3, 3), beta=0.1), "ref_logp has shape"),
    (dict(token_weights=torch.ones(2)), "token_weights has shape"),
    (dict(agg="mean"), "agg='mean' is unknown"),
    (dict(ratio_level="seq"), "ratio_level='seq' is unknown"),
    (dict(kl_kind="k4", ref_logp=torch.zeros(2, 3), beta=0.1), "kl_kind='k4' is unknown"),
    (dict(agg="seq-mean-token-sum-norm"), "needs max_tokens"),
    (dict(agg="seq-mean-token-sum-norm", max_tokens=0), "max_tokens=0"),
    (dict(beta=0.04), "needs ref_logp"),
    (dict(beta=-1.0, ref_logp=torch.zeros(2, 3)), "beta=-1.0"),
    (dict(eps_low=-0.1), "clip ranges"),
    (dict(dual_clip=0.5), "dual_clip=0.5"),
    (dict(delta=1.0), "delta=1.0"),
    (dict(normalizer=0), "normalizer=0"),
    (dict(entropy_coef=0.01), "entropy_coef=0.01 > 0 needs entropy"),
    (dict(entropy_coef=0.01, entropy=torch.zeros(2, 4)), "entropy has shape"),
    (dict(entropy_coef=-0.01, entropy=torch.zeros(2, 3)), "entropy_coef=-0.01 must be a finite number >= 0"),
])
def test_policy_loss_bad_input(change, match):
    logp, old, adv, mask = _args()
    kw = dict(logp=logp, old_logp=old, advantages=adv, mask=mask)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        policy_loss(**kw)


# ---------------------------------------------------------------- LossParams: the knobs built once

@pytest.mark.parametrize("knobs", [
    {},
    dict(eps_low=0.1, eps_high=0.3, agg="token-mean", beta=0.05, kl_kind="k2", dual_clip=3.0, delta=4.0),
    dict(ratio_level="sequence", agg="seq-mean-token-sum-norm", max_tokens=L_MAX),
    dict(loss_type="sapo", sapo_tau_pos=0.5, sapo_tau_neg=2.0, agg="token-mean"),
])
def test_params_and_the_keyword_form_give_the_same_loss(knobs):
    logp, old, ref, adv, mask = ragged_batch(3, 4, 5)
    logp.requires_grad_(True)
    by_keywords = policy_loss(logp, old, adv, mask, ref_logp=ref, normalizer=6, **knobs)
    by_params = policy_loss(logp, old, adv, mask, LossParams(**knobs), ref_logp=ref, normalizer=6)
    assert torch.equal(by_keywords[0], by_params[0]) and by_keywords[1] == by_params[1]


def test_params_are_validated_once_at_construction_with_the_loss_messages():
    assert LossParams(eps_low=0.3).eps_high == 0.3  # eps_high None means eps_low
    for knobs, match in [(dict(agg="mean"), "agg='mean' is unknown"), (dict(loss_type="ppo"), "loss_type='ppo'"),
                         (dict(eps_high=-1.0), "clip ranges"), (dict(dual_clip=1.0), "dual_clip=1.0"),
                         (dict(loss_type="cispo", delta=4.0), "delta=4.0 with loss_type=cispo: it shapes the PPO"),
                         (dict(sapo_tau_pos=0.0), "sapo_temperature_pos=0.0, sapo_temperature_neg=1.05 must be pos")]:
        with pytest.raises(ValueError, match=match):
            LossParams(**knobs)
    params = LossParams(beta=0.1)
    with pytest.raises(AttributeError):
        params.beta = 0.0  # frozen
    logp, old, adv, mask = _args()
    with pytest.raises(ValueError, match="needs ref_logp"):  # depends on the call, checked per call
        policy_loss(logp, old, adv, mask, params)
    with pytest.raises(TypeError, match=r"got params and the keywords \['agg'\]"):
        policy_loss(logp, old, adv, mask, params, agg="token-mean")
