"""REINFORCE++, REINFORCE++-baseline, GRPO pass@k and GDPO normalize_then_sum
(core/advantage_variants.py) against hand-worked numbers and naive loops."""

import math
import statistics

import pytest
import torch

from grouprl.core import (
    compute_advantages,
    normalize_then_sum,
    passk_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)

TWO_GROUPS = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])


def close(got, want, tol=1e-6):
    assert got.shape == (len(want),)
    assert got.tolist() == pytest.approx(want, abs=tol)


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_pp_worked_numbers():
    """[1,0,0,0 | 1,1,1,1]: batch mean 0.625, sample std sqrt((5·0.375² + 3·0.625²)/7) = 0.5175492.
    A = (r − 0.625)/0.5175492: 0.7245688 and −1.2076147. The all-ones group is not zeroed: the
    baseline is the batch, not the group."""
    got = reinforce_pp_advantages(TWO_GROUPS, 4, eps=0.0)
    close(got, [0.7245688, -1.2076147, -1.2076147, -1.2076147] + [0.7245688] * 4)
    close(reinforce_pp_advantages(TWO_GROUPS, 4, scale="none"), [0.375, -0.625, -0.625, -0.625] + [0.375] * 4)


def test_reinforce_pp_baseline_worked_numbers_and_differs_from_grpo_batch_scale():
    """Centre in the group: [0.75, −0.25, −0.25, −0.25 | 0, 0, 0, 0]; mean 0; sample std
    sqrt((0.5625 + 3·0.0625)/7) = 0.3273268. A = [2.2912878, −0.7637626 ×3 | 0 ×4].
    GRPO scale="batch" divides the same centred values by the std of the raw rewards (0.5175492):
    [1.4491377, −0.4830459, ...] — smaller, because the spread between prompts counts there."""
    got = reinforce_pp_baseline_advantages(TWO_GROUPS, 4, eps=0.0)
    close(got, [2.2912878, -0.7637626, -0.7637626, -0.7637626, 0, 0, 0, 0])
    assert got[4:].eq(0).all()  # flat group: exactly 0
    close(compute_advantages("grpo", TWO_GROUPS, 4, scale="batch", eps=0.0),
          [1.4491377, -0.4830459, -0.4830459, -0.4830459, 0, 0, 0, 0])


@pytest.mark.parametrize("seed", range(5))
def test_reinforce_pp_forms_match_naive_loops(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(12, generator=g, dtype=torch.float64)
    xs = r.tolist()
    mu, sd = statistics.mean(xs), statistics.stdev(xs)
    close(reinforce_pp_advantages(r, 3, eps=1e-4), [(x - mu) / (sd + 1e-4) for x in xs], 1e-9)
    centred = []
    for b in range(4):
        grp = xs[3 * b:3 * b + 3]
        centred += [x - statistics.mean(grp) for x in grp]
    mu_c, sd_c = statistics.mean(centred), statistics.stdev(centred)
    close(reinforce_pp_baseline_advantages(r, 3, eps=1e-4), [(c - mu_c) / (sd_c + 1e-4) for c in centred], 1e-9)


def test_reinforce_pp_rejects_group_scale():
    with pytest.raises(ValueError, match="normalises over the whole batch: use scale 'batch'"):
        compute_advantages("reinforce_pp_baseline", TWO_GROUPS, 4, scale="group")


# ---------------------------------------------------------------- pass@k

def test_passk_worked_numbers():
    """Only each group's best gets r_max − r_second_max: [0.9, 0.3, 0.8, 0.2] → [0.1, 0, 0, 0];
    [0, 1, 0, 0] → [0, 1, 0, 0]; a tie for the best, [1, 1, 0, 0] → all 0 (a pass@4 that loses
    either correct sample still passes). scale="group" (verl's default) divides by the group's
    sample std: [0, 1, 0, 0] has std 0.5 → 2."""
    r = torch.tensor([0.9, 0.3, 0.8, 0.2, 0, 1, 0, 0, 1, 1, 0, 0])
    close(passk_advantages(r, 4), [0.1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    got = passk_advantages(r, 4, scale="group", eps=0.0)
    assert got[4:8].tolist() == [0.0, 2.0, 0.0, 0.0] and got[8:].eq(0).all()


@pytest.mark.parametrize("seed", range(5))
def test_passk_is_the_leave_one_out_max(seed):
    """A_i = max(group) − max(group without i): the leave-one-out pass@G estimator, by a loop."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 4, (15,), generator=g).float()  # ties happen
    want = []
    for b in range(3):
        grp = r[5 * b:5 * b + 5].tolist()
        for i in range(5):
            loo = max(grp[:i] + grp[i + 1:])
            want.append(max(grp) - loo)
    # the estimator's value per completion is the same; only a tie's attribution differs (0 either way)
    close(passk_advantages(r, 5), want)


# ---------------------------------------------------------------- GDPO

def test_gdpo_worked_numbers_one_reward_does_not_drown_the_other():
    """f1 spread 10, f2 spread 1: f1 = [10, 0, 0, 0], f2 = [0, 1, 1, 1]. Summed first (GRPO):
    [10, 1, 1, 1] → [1.5, −0.5, −0.5, −0.5], f2 has no say. GDPO: f1 → [1.5, −0.5, −0.5, −0.5],
    f2 → [−1.5, 0.5, 0.5, 0.5] (sample std 0.5), sum [0, 0, 0, 0]: the two objectives cancel, and
    the group carries no signal (exactly 0 with eps = 0; with eps > 0 the two terms differ by ~eps and
    the batch whitening blows that up when every group cancels — GDPO's, and TRL's, behaviour)."""
    per_func = torch.tensor([[10.0, 0], [0, 1], [0, 1], [0, 1]])
    close(compute_advantages("grpo", per_func.sum(-1), 4, eps=0.0), [1.5, -0.5, -0.5, -0.5])
    assert normalize_then_sum(per_func, None, 4, eps=0.0).tolist() == [0.0] * 4


def test_gdpo_worked_numbers_batch_whitening_and_weights():
    """G = 2, f1 = [1, 0 | 1, 1], f2 = [0, 1 | 0, 1]. Per group (sample std of two values: |a−b|/√2):
    f1 → [0.7071, −0.7071 | 0, 0], f2 → [−0.7071, 0.7071 | −0.7071, 0.7071]. Weights (1, 1): S =
    [0, 0 | −0.7071, 0.7071], batch mean 0, sample std sqrt(1/3) = 0.5773503 → [0, 0 | −1.2247449,
    1.2247449]. Weights (3, 1): S = [1.4142, −1.4142 | −0.7071, 0.7071], std sqrt(5/3) = 1.2909944
    → [1.0954451, −1.0954451, −0.5477226, 0.5477226]."""
    per_func = torch.tensor([[1.0, 0], [0, 1], [1, 0], [1, 1]])
    close(normalize_then_sum(per_func, None, 2, eps=0.0), [0, 0, -1.2247449, 1.2247449])
    close(normalize_then_sum(per_func, [3.0, 1.0], 2, eps=0.0), [1.0954451, -1.0954451, -0.5477226, 0.5477226])


@pytest.mark.parametrize("seed", range(4))
def test_gdpo_matches_naive_loop_with_missing_scores(seed):
    """NaN (a function returned None) is left out of its group's mean/std and adds 0 to the row;
    a row nobody scored gets 0 and is left out of the batch statistics."""
    g = torch.Generator().manual_seed(seed)
    n, gs, k = 12, 4, 3
    x = torch.randn(n, k, generator=g, dtype=torch.float64)
    x[torch.rand(n, k, generator=g) < 0.2] = math.nan
    x[5] = math.nan
    w = [1.0, 0.5, 2.0]
    eps = 1e-4
    s = [0.0] * n
    for b in range(n // gs):
        for f in range(k):
            vals = [(i, float(x[i, f])) for i in range(b * gs, b * gs + gs) if not math.isnan(x[i, f])]
            if len(vals) < 2 or len({v for _, v in vals}) == 1:
                continue
            mu = statistics.mean(v for _, v in vals)
            sd = statistics.stdev(v for _, v in vals)
            for i, v in vals:
                s[i] += w[f] * (v - mu) / (sd + eps)
    scored = [i for i in range(n) if not all(math.isnan(float(v)) for v in x[i])]
    mu = statistics.mean(s[i] for i in scored)
    sd = statistics.stdev(s[i] for i in scored)
    want = [(s[i] - mu) / (sd + eps) if i in scored else 0.0 for i in range(n)]
    close(normalize_then_sum(x, w, gs, eps=eps), want, 1e-5)


def test_gdpo_bad_input():
    with pytest.raises(ValueError, match="2 weights for 3 reward functions"):
        normalize_then_sum(torch.zeros(4, 3), [1.0, 2.0], 2)
    with pytest.raises(ValueError, match=r"per_func must be a \[N, K\] tensor"):
        normalize_then_sum(torch.zeros(4), None, 2)
    with pytest.raises(ValueError, match="group_size=3"):
        normalize_then_sum(torch.zeros(4, 1), None, 3)
