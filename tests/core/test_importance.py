"""importance_weights against hand-worked numbers, a naive loop for every mode, and invariants."""

import math

import pytest
import torch

from grouprl.core import IS_MODES, importance_weights, kl_estimate, register_is_mode

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
NAN, INF = float("nan"), float("inf")


def batch_from_ratios(ratios: list[list[float]], t: int):
    """float64 (old, q, mask) whose real tokens have ratio w = exp(old − q) = ratios[i][j]; padding
    holds garbage (nan, inf) that must change nothing."""
    g = torch.Generator().manual_seed(0)
    q = -3 * torch.rand(len(ratios), t, generator=g, dtype=torch.float64)  # [N, T]
    old = torch.full_like(q, NAN)
    mask = torch.zeros(len(ratios), t, dtype=torch.bool)
    for i, row in enumerate(ratios):
        for j, w in enumerate(row):
            old[i, j], mask[i, j] = q[i, j] + math.log(w), True
    q = torch.where(mask, q, torch.tensor(-INF, dtype=torch.float64))
    return old, q, mask


# Three completions, T = 3: w = [2, 0.5, 4], [1.25, ·, ·], [0.8, 0.5, ·].
HAND = [[2.0, 0.5, 4.0], [1.25], [0.8, 0.5]]


@pytest.mark.parametrize("mode, cap_min, want, frac, ratio_mean, ratio_max", [
    # C = 3: only w = 4 exceeds it (1 of 6 tokens); mean w = (2+0.5+4+1.25+0.8+0.5)/6 = 9.05/6
    ("token_truncate", 0.0, [[2, 0.5, 3], [1.25, 0, 0], [0.8, 0.5, 0]], 1 / 6, 9.05 / 6, 4.0),
    # band [0.6, 3]: 0.5, 4 and 0.5 fall outside (3 of 6 tokens)
    ("token_mask", 0.6, [[1, 0, 0], [1, 0, 0], [1, 0, 0]], 3 / 6, 9.05 / 6, 4.0),
    # W = [2·0.5·4, 1.25, 0.8·0.5] = [4, 1.25, 0.4]: W_0 truncated to 3 (1 of 3 completions)
    ("sequence_truncate", 0.0, [[3, 3, 3], [1.25, 0, 0], [0.4, 0.4, 0]], 1 / 3, 5.65 / 3, 4.0),
    # band [0.6, 3]: 4 and 0.4 fall outside (2 of 3 completions)
    ("sequence_mask", 0.6, [[0, 0, 0], [1, 0, 0], [0, 0, 0]], 2 / 3, 5.65 / 3, 4.0),
    # no lower bound (TRL): 0.4 is kept
    ("sequence_mask", 0.0, [[0, 0, 0], [1, 0, 0], [1, 1, 0]], 1 / 3, 5.65 / 3, 4.0),
])
def test_hand_worked(mode, cap_min, want, frac, ratio_mean, ratio_max):
    """C = 3. k3 per token is w − ln w − 1; over the 6 real tokens Σw = 9.05 and Πw = 2·0.5·4·1.25·0.8·0.5
    = 2, so the mean k3 = (9.05 − 6 − ln 2)/6 = 0.392809..., whatever the mode."""
    old, q, mask = batch_from_ratios(HAND, 3)
    weights, stats = importance_weights(old, q, mask, mode, cap=3.0, cap_min=cap_min)
    assert weights.shape == (3, 3) and weights.dtype == torch.float64
    torch.testing.assert_close(weights, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert stats["mismatch_k3"] == pytest.approx((3.05 - math.log(2)) / 6, rel=1e-12)
    assert stats["frac_corrected"] == pytest.approx(frac, rel=1e-15)
    assert stats["ratio_mean"] == pytest.approx(ratio_mean, rel=1e-12)
    assert stats["ratio_max"] == pytest.approx(ratio_max, rel=1e-12)


def naive(old, q, mask, mode, cap, cap_min):
    """Scalar Python loops written from the module docstring, in ratio space (no logs)."""
    n, t = old.shape
    weights = [[0.0] * t for _ in range(n)]
    ratios, corrected, k3 = [], [], []
    for i in range(n):
        toks = [j for j in range(t) if mask[i, j]]
        w = {j: math.exp(float(old[i, j]) - float(q[i, j])) for j in toks}
        k3 += [w[j] - math.log(w[j]) - 1 for j in toks]
        units = [[j] for j in toks] if mode.startswith("token") else ([toks] if toks else [])
        for unit in units:
            r = math.prod(w[j] for j in unit)
            if mode.endswith("truncate"):
                weight, hit = min(r, cap), r > cap
            else:
                weight, hit = float(cap_min <= r <= cap), not cap_min <= r <= cap
            ratios.append(r)
            corrected.append(hit)
            for j in unit:
                weights[i][j] = weight
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    stats = {"mismatch_k3": mean(k3), "ratio_mean": mean(ratios), "ratio_max": max(ratios, default=0.0),
             "frac_corrected": mean([float(c) for c in corrected])}
    return torch.tensor(weights, dtype=torch.float64), stats


def ragged(seed, n, t, spread):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [N, T]
    q = -3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    old = q + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    return old, q, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed, spread, cap, cap_min", [(0, 0.3, 1.2, 0.8), (1, 1.0, 2.0, 0.5), (2, 0.05, 3.0, 0.0),
                                                         (3, 0.6, 1.0, 0.9)])
def test_matches_naive_loop(mode, seed, spread, cap, cap_min):
    if mode.endswith("truncate"):
        cap_min = 0.0
    old, q, mask = ragged(seed, 7, 6, spread)
    weights, stats = importance_weights(old, q, mask, mode, cap=cap, cap_min=cap_min)
    want_w, want_stats = naive(old, q, mask, mode, cap, cap_min)
    torch.testing.assert_close(weights, want_w, rtol=1e-12, atol=1e-15)
    assert stats == pytest.approx(want_stats, rel=1e-12, abs=1e-15)
    if spread >= 0.3:  # the bounds act in these cases, so the test would see a wrong bound
        assert stats["frac_corrected"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_padding_never_contributes(mode):
    """Garbage in padded positions and extra padding columns change neither weights nor stats."""
    old, q, mask = ragged(4, 5, 4, 0.7)
    weights, stats = importance_weights(old, q, mask, mode, cap=1.5, cap_min=0.0 if "truncate" in mode else 0.7)
    wide = lambda x, fill: torch.cat([x, torch.full((5, 3), fill, dtype=x.dtype)], 1)  # noqa: E731
    old2 = torch.where(mask, old, torch.tensor(INF, dtype=torch.float64))
    q2 = torch.where(mask, q, torch.tensor(NAN, dtype=torch.float64))
    w2, stats2 = importance_weights(wide(old2, NAN), wide(q2, -INF), wide(mask, False), mode, cap=1.5,
                                    cap_min=0.0 if "truncate" in mode else 0.7)
    assert torch.equal(w2[:, :4], weights) and torch.equal(w2[:, 4:], torch.zeros(5, 3, dtype=torch.float64))
    assert (weights[~mask] == 0).all()
    assert stats2 == pytest.approx(stats, rel=1e-14)  # only the summation order may differ


@pytest.mark.parametrize("mode", MODES)
def test_no_gradient_flows_through_the_weights(mode):
    old, q, mask = ragged(5, 4, 5, 0.5)
    old.requires_grad_(True)
    q.requires_grad_(True)
    weights, _ = importance_weights(old, q, mask, mode, cap=1.5)
    assert not weights.requires_grad and weights.grad_fn is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cap, cap_min", [(3.0, 0.0), (1.0, 1.0)])
def test_no_mismatch_gives_weight_one_and_zero_metrics(mode, cap, cap_min):
    """old == q: w = 1 everywhere, kept even by the tightest band [1, 1]."""
    _, q, mask = ragged(6, 6, 5, 0.0)
    weights, stats = importance_weights(q.clone(), q, mask, mode, cap=cap,
                                        cap_min=0.0 if "truncate" in mode else cap_min)
    assert torch.equal(weights, mask.double())
    assert stats == {"mismatch_k3": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "frac_corrected": 0.0}


def test_mismatch_k3_is_kl_py_estimate_of_sampler_to_trainer():
    old, q, mask = ragged(7, 4, 5, 0.4)
    _, stats = importance_weights(old, q, mask, "token_truncate", cap=2.0)
    want = kl_estimate(q, old, "k3")[mask].mean()  # δ = q − old: samples come from the sampler
    assert stats["mismatch_k3"] == pytest.approx(float(want), rel=1e-12)
    assert stats["mismatch_k3"] != pytest.approx(float(kl_estimate(old, q, "k3")[mask].mean()), rel=1e-3)


def test_long_sequence_ratio_overflow_gives_cap_or_zero_not_inf():
    """200 tokens each with log w = 1 in float32: W = e^200 overflows float32, the weight does not."""
    q = torch.full((1, 200), -2.0)
    old, mask = q + 1.0, torch.ones(1, 200, dtype=torch.bool)
    w_trunc, stats = importance_weights(old, q, mask, "sequence_truncate", cap=2.0)
    w_mask, _ = importance_weights(old, q, mask, "sequence_mask", cap=2.0)
    assert torch.allclose(w_trunc, torch.full_like(q, 2.0), rtol=1e-6) and torch.equal(w_mask, torch.zeros_like(q))
    assert stats["ratio_max"] == pytest.approx(math.exp(200), rel=1e-5) and stats["frac_corrected"] == 1.0


def test_empty_mask_gives_zero_weights_and_zero_metrics():
    old, q, _ = ragged(8, 3, 4, 0.5)
    weights, stats = importance_weights(old, q, torch.zeros(3, 4, dtype=torch.bool), "sequence_mask")
    assert torch.equal(weights, torch.zeros_like(old)) and set(stats.values()) == {0.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "token"}, "mode='token' is unknown; use one of"),
    ({"cap": 0.9}, "cap=0.9 must be >= 1"),
    ({"cap_min": 1.5}, r"cap_min=1.5 must be in \[0, 1\]"),
    ({"mode": "token_truncate", "cap_min": 0.5}, "cap_min=0.5 has no effect with mode='token_truncate'"),
])
def test_bad_arguments_name_the_fix(kwargs, message):
    old, q, mask = ragged(9, 2, 3, 0.1)
    with pytest.raises(ValueError, match=message):
        importance_weights(old, q, mask, **kwargs)
    with pytest.raises(ValueError, match=r"sampling_logp has shape \(2, 2\), expected \(2, 3\)"):
        importance_weights(old, q[:, :2], mask)


def test_registry_holds_the_four_modes_and_refuses_duplicates():
    assert sorted(IS_MODES) == sorted(MODES)
    with pytest.raises(ValueError, match="'token_mask' is already registered"):
        register_is_mode("token_mask")(lambda log_ratio, cap, cap_min: None)
