"""Advantages against ALGORITHMS.md worked numbers, naive Python loops, and invariants."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.core import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_advantages,
    process_advantages,
    register_advantage_estimator,
    rloo_advantages,
    zero_std_groups,
)

T64 = dict(dtype=torch.float64)


# ---------------------------------------------------------------- worked numbers (ALGORITHMS.md)

def test_worked_one_correct_of_four():
    """[1,0,0,0]: mean 0.25, sample std = sqrt((0.5625 + 3·0.0625)/3) = 0.5."""
    r = torch.tensor([1.0, 0, 0, 0], **T64)
    torch.testing.assert_close(group_advantages(r, 4, eps=0.0), torch.tensor([1.5, -0.5, -0.5, -0.5], **T64))
    torch.testing.assert_close(group_advantages(r, 4, scale="none"),
                               torch.tensor([0.75, -0.25, -0.25, -0.25], **T64))
    torch.testing.assert_close(rloo_advantages(r, 4), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], **T64))
    # with the default eps the denominator is std + 1e-4
    torch.testing.assert_close(group_advantages(r, 4), torch.tensor([0.75, -0.25, -0.25, -0.25], **T64) / 0.5001)


def test_worked_graded_rewards_sample_and_population_std():
    r = torch.tensor([0.9, 0.3, 0.8, 0.2], **T64)
    sample = group_advantages(r, 4, eps=0.0)
    population = group_advantages(r, 4, eps=0.0, unbiased=False)
    torch.testing.assert_close(sample, torch.tensor([0.9966, -0.7119, 0.7119, -0.9966], **T64),
                               atol=5e-5, rtol=0)
    torch.testing.assert_close(population, torch.tensor([1.1508, -0.8220, 0.8220, -1.1508], **T64),
                               atol=5e-5, rtol=0)
    assert r.std().item() == pytest.approx(0.3512, abs=5e-5)


# ---------------------------------------------------------------- naive loops

def naive_advantages(rewards, g, scale, eps, unbiased, rloo=False):
    std_fn = statistics.stdev if unbiased else statistics.pstdev
    batch_std = std_fn(rewards)
    out = []
    for b in range(0, len(rewards), g):
        group = rewards[b:b + g]
        mean = sum(group) / g
        std = {"group": std_fn(group), "batch": batch_std, "none": None}[scale]
        for i, r in enumerate(group):
            centered = r - (sum(group) - r) / (g - 1) if rloo else r - mean
            if len(set(group)) == 1:
                out.append(0.0)
            else:
                out.append(centered if std is None else centered / (std + eps))
    return out


# rounded: differences like 1e-183 are not rewards, they only test float underflow of std
rounded_floats = st.floats(-5, 5).map(lambda x: round(x, 3))
rewards_strategy = st.integers(2, 6).flatmap(lambda g: st.tuples(
    st.just(g),
    st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]) | rounded_floats, min_size=g, max_size=g),
             min_size=1, max_size=5)))


@settings(max_examples=60, deadline=None)
@given(data=rewards_strategy, scale=st.sampled_from(["group", "batch", "none"]), unbiased=st.booleans(),
       eps=st.sampled_from([0.0, 1e-4, 1e-6]), estimator=st.sampled_from(["grpo", "rloo"]))
def test_estimators_match_naive_loops(data, scale, unbiased, eps, estimator):
    g, groups = data
    flat = [x for grp in groups for x in grp]
    if scale != "none" and len(set(flat)) == 1:
        scale = "none"  # batch std 0 with eps 0 is 0/0 in the naive reference; every group is flat anyway
    got = compute_advantages(estimator, torch.tensor(flat, **T64), g, scale=scale, eps=eps, unbiased=unbiased)
    want = naive_advantages(flat, g, scale, eps, unbiased, rloo=estimator == "rloo")
    assert got.shape == (len(flat),)
    torch.testing.assert_close(got, torch.tensor(want, **T64), rtol=1e-9, atol=1e-9)


def test_rloo_is_rescaled_dr_grpo():
    r = torch.randn(24, generator=torch.Generator().manual_seed(0), **T64)
    torch.testing.assert_close(rloo_advantages(r, 6), 6 / 5 * group_advantages(r, 6, scale="none"))


# ---------------------------------------------------------------- invariants

@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_equal_group_is_exactly_zero(scale, estimator, dtype):
    # 0.1 is not representable: a float mean of three copies need not equal 0.1 exactly
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.7, 0.3, 0.3, 0.3], dtype=dtype)
    adv = compute_advantages(estimator, r, 3, scale=scale)
    assert adv.dtype == dtype
    assert (adv[:3] == 0).all() and (adv[6:] == 0).all()
    assert (adv[3:6] != 0).all()


def test_zero_std_groups_and_integer_rewards():
    r = torch.tensor([1, 1, 0, 1, 0, 0, 3, 3])
    assert zero_std_groups(r, 2).tolist() == [True, False, True, True]
    adv = group_advantages(r, 2, eps=0.0)
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.0, 0.0, -0.7071067690849304, 0.7071067690849304, 0.0, 0.0, 0.0, 0.0]


def test_register_custom_estimator():
    @register_advantage_estimator("test_sign")
    def sign(rewards, group_size, *, scale, eps, unbiased):
        return torch.sign(group_advantages(rewards, group_size, scale="none"))

    try:
        got = compute_advantages("test_sign", torch.tensor([2.0, 0.0, 1.0, 1.0]), 2)
        assert got.tolist() == [1.0, -1.0, 0.0, 0.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_sign")(sign)
    finally:
        del ADVANTAGE_ESTIMATORS["test_sign"]


# ---------------------------------------------------------------- process supervision

def test_process_hand_worked():
    """Group of 2: completion 0 has steps (r=1, ends at 1), (r=0, ends at 3); completion 1 one step
    (r=0, ends at 2). R = [1, 0, 0]: mean 1/3, sample std sqrt(1/3) = 0.57735, so r̃ = [2/√3·… ]:
    r̃(1) = (2/3)/0.57735 = 1.15470, r̃(0) = −0.57735. Token advantages are suffix sums over steps."""
    got = process_advantages([[1.0, 0.0], [0.0]], [[1, 3], [2]], 2, 5, eps=0.0)
    a, b = 2 / 3 / (1 / 3) ** 0.5, -1 / 3 / (1 / 3) ** 0.5
    want = torch.tensor([[a + b, a + b, b, b, 0.0], [b, b, b, 0.0, 0.0]])
    assert got.shape == (2, 5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def naive_process(step_rewards, step_ends, g, t_len, eps, unbiased):
    std_fn = statistics.stdev if unbiased else statistics.pstdev
    out = []
    for b in range(0, len(step_rewards), g):
        pooled = [r for rs in step_rewards[b:b + g] for r in rs]
        flat = len(set(pooled)) <= 1
        mean = sum(pooled) / len(pooled) if pooled else 0.0
        std = 0.0 if flat else std_fn(pooled)
        for rs, es in zip(step_rewards[b:b + g], step_ends[b:b + g]):
            norm = [0.0 if flat else (r - mean) / (std + eps) for r in rs]
            out.append([sum((n for n, e in zip(norm, es) if e >= t), 0.0) for t in range(t_len)])
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), g=st.integers(2, 4), b=st.integers(1, 3), t_len=st.integers(1, 8),
       unbiased=st.booleans(), eps=st.sampled_from([0.0, 1e-4]))
def test_process_matches_naive(data, g, b, t_len, unbiased, eps):
    step_rewards, step_ends = [], []
    for _ in range(g * b):
        k = data.draw(st.integers(0, 3))
        step_rewards.append(data.draw(st.lists(st.sampled_from([0.0, 1.0]) | rounded_floats,
                                               min_size=k, max_size=k)))
        step_ends.append(data.draw(st.lists(st.integers(0, t_len - 1), min_size=k, max_size=k)))
    got = process_advantages(step_rewards, step_ends, g, t_len, eps=eps, unbiased=unbiased)
    want = torch.tensor(naive_process(step_rewards, step_ends, g, t_len, eps, unbiased))
    torch.testing.assert_close(got, want.reshape(g * b, t_len), rtol=1e-5, atol=1e-5)


def test_process_all_equal_group_is_exactly_zero():
    got = process_advantages([[0.3, 0.3], [0.3]], [[0, 2], [1]], 2, 4)
    assert (got == 0).all()


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, exc, match", [
    (lambda: group_advantages(torch.ones(4), 1), ValueError, "group_size=1"),
    (lambda: group_advantages(torch.ones(6), 4), ValueError, "do not split into groups"),
    (lambda: group_advantages(torch.ones(4), 2.0), TypeError, "must be an int"),
    (lambda: group_advantages(torch.ones(2, 2), 2), ValueError, "flat"),
    (lambda: group_advantages([1.0, 0.0], 2), TypeError, "torch.tensor"),
    (lambda: group_advantages(torch.tensor([1.0, float("nan")]), 2), ValueError, r"rewards\[1\] = nan"),
    (lambda: group_advantages(torch.tensor([float("inf"), 0.0]), 2), ValueError, "not finite"),
    (lambda: group_advantages(torch.ones(4), 2, scale="std"), ValueError, "scale='std'"),
    (lambda: group_advantages(torch.ones(4), 2, eps=-1.0), ValueError, "eps"),
    (lambda: compute_advantages("ppo", torch.ones(4), 2), ValueError, "'grpo', 'grpo_passk', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo'"),
    (lambda: rloo_advantages(torch.ones(3), 1), ValueError, "group_size=1"),
    (lambda: zero_std_groups(torch.ones(5), 2), ValueError, "group_size=2"),
    (lambda: process_advantages([[1.0], [0.0]], [[0]], 2, 3), ValueError, "step_ends has 1"),
    (lambda: process_advantages([[1.0], [0.0]], [[0, 1], [0]], 2, 3), ValueError, "completion 0"),
    (lambda: process_advantages([[1.0], [0.0]], [[3], [0]], 2, 3), ValueError, "step_ends must lie"),
    (lambda: process_advantages([[1.0], [0.0]], [[0], [0]], 2, 0), ValueError, "num_tokens"),
    (lambda: process_advantages([[float("nan")], [0.0]], [[0], [0]], 2, 2), ValueError, "finite"),
    (lambda: process_advantages([[1.0]], [[0]], 1, 2), ValueError, "group_size=1"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
