"""Multi-objective aggregation (core/multi_objective.py): GDPO's normalize_then_sum against hand-worked
numbers and a naive loop, and the registered aggregations."""

import math
import statistics

import pytest
import torch

from grouprl.core import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    AdvantageInputs,
    compute_advantages,
    normalize_then_sum,
)

def close(got, want, tol=1e-6):
    assert got.shape == (len(want),)
    assert got.tolist() == pytest.approx(want, abs=tol)


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


# ---------------------------------------------------------------- the registry

def test_sum_then_normalize_hands_the_summed_rewards_to_the_estimator():
    """GRPO's default: the estimator sees the weighted sum (AdvantageInputs.rewards), not the functions."""
    per_func = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, 0.0], [2.0, 1.0]])
    inputs = AdvantageInputs(per_func.sum(-1), 2, per_func, [1.0, 1.0])
    agg = MULTI_OBJECTIVE_AGGREGATIONS.get("sum_then_normalize")
    for name in ("grpo", "rloo", "reinforce_pp_baseline"):
        scale = "batch" if name.startswith("reinforce") else "group"
        got = agg(inputs, ADVANTAGE_ESTIMATORS.get(name), scale=scale, eps=1e-4)
        assert torch.equal(got, compute_advantages(name, per_func.sum(-1), 2, scale=scale))


def test_normalize_then_sum_is_gdpo_on_each_function():
    per_func = torch.tensor([[1.0, 0.0], [0.0, 3.0], [0.0, math.nan], [2.0, 1.0]])
    inputs = AdvantageInputs(per_func.nan_to_num().sum(-1), 2, per_func, [3.0, 1.0])
    got = MULTI_OBJECTIVE_AGGREGATIONS.get("normalize_then_sum")(inputs, ADVANTAGE_ESTIMATORS.get("grpo"),
                                                                 scale="group", eps=1e-4)
    assert torch.equal(got, normalize_then_sum(per_func, [3.0, 1.0], 2))
    with pytest.raises(ValueError, match="reads each reward function's scores"):
        MULTI_OBJECTIVE_AGGREGATIONS.get("normalize_then_sum")(AdvantageInputs(torch.zeros(4), 2), None,
                                                               scale="group", eps=1e-4)
    assert MULTI_OBJECTIVE_AGGREGATIONS.names() == ("sum_then_normalize", "normalize_then_sum")
