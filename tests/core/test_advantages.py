"""Outcome advantage estimators (core/advantages.py: GRPO, Dr. GRPO, RLOO, REINFORCE++, REINFORCE++-baseline,
GRPO pass@k) against docs/algorithms.md worked numbers, naive Python loops, and invariants."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.core import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_advantages,
    passk_advantages,
    register_advantage_estimator,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    zero_std_groups,
)

T64 = dict(dtype=torch.float64)


# ---------------------------------------------------------------- worked numbers (docs/algorithms.md)

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


def test_flat_rewards_give_zero_advantages_even_without_eps():
    """advantage_eps: 0 is allowed: a batch (REINFORCE++'s whitening) or a group (pass@k) with nothing
    between its rewards gets advantages of exactly 0, as GRPO's all-equal groups do, not 0/0 = NaN."""
    assert reinforce_pp_advantages(torch.zeros(8), 4, eps=0.0).tolist() == [0.0] * 8
    assert reinforce_pp_baseline_advantages(torch.ones(8), 4, eps=0.0).tolist() == [0.0] * 8
    got = compute_advantages("grpo_passk", torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, scale="group", eps=0.0)
    close(got, torch.tensor([0.0, 0.0, 0.0, 2 ** 0.5]))
    got = compute_advantages("grpo_passk", torch.ones(4), 2, scale="batch", eps=0.0)
    assert got.tolist() == [0.0] * 4


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
    (lambda: compute_advantages("ppo", torch.ones(4), 2), ValueError,
     "'grpo', 'grpo_passk', 'process', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo'"),
    (lambda: rloo_advantages(torch.ones(3), 1), ValueError, "group_size=1"),
    (lambda: zero_std_groups(torch.ones(5), 2), ValueError, "group_size=2"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
