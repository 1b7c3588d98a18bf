"""Process-supervision advantages (core/process_advantages.py) against a hand-worked case, a naive loop
and invariants."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.core import (ADVANTAGE_ESTIMATORS, AdvantageInputs, group_advantages, process_advantages,
                          zero_std_step_groups)

# rounded: differences like 1e-183 are not rewards, they only test float underflow of std
rounded_floats = st.floats(-5, 5).map(lambda x: round(x, 3))


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



def test_zero_std_step_groups_are_the_groups_process_advantages_zeroes():
    """Group 0 has equal per-completion means (0.5, 0.5) but unequal steps: not flat, and its
    advantages are not 0. Group 1's steps are all 0.3 (one completion has none): flat. Group 2 has
    no steps at all: flat."""
    steps = [[1.0, 0.0], [0.0, 1.0], [0.3, 0.3], [], [], []]
    ends = [[0, 2], [0, 2], [1, 2], [], [], []]
    assert zero_std_step_groups(steps, 2).tolist() == [False, True, True]
    adv = process_advantages(steps, ends, 2, 3)
    assert adv[:2].abs().max() > 0 and (adv[2:] == 0).all()


def test_one_step_at_the_last_token_is_outcome_supervision():
    """DeepSeekMath §4.1.2 inside §4.1.3: one step per completion, at its last token, gives every token
    of completion i the GRPO advantage of its outcome reward."""
    rewards, lengths = [1.0, 0.0, 0.5, 0.25], [3, 1, 4, 2]
    got = process_advantages([[r] for r in rewards], [[n - 1] for n in lengths], 4, 5)  # [N, T]
    want = group_advantages(torch.tensor(rewards), 4)  # [N]
    for i, n in enumerate(lengths):
        torch.testing.assert_close(got[i, :n], want[i].expand(n), rtol=0, atol=1e-6)
        assert (got[i, n:] == 0).all()


def test_registered_estimator_reads_the_steps_of_advantage_inputs():
    steps, ends = [[1.0, 0.0], [0.0]], [[1, 3], [2]]
    inputs = AdvantageInputs(torch.zeros(2), 2, step_rewards=steps, step_ends=ends, num_tokens=5)
    got = ADVANTAGE_ESTIMATORS.get("process")(inputs, scale="batch", eps=1e-3, unbiased=False)
    assert torch.equal(got, process_advantages(steps, ends, 2, 5, scale="batch", eps=1e-3, unbiased=False))
    with pytest.raises(ValueError, match="'process' reads step rewards"):
        ADVANTAGE_ESTIMATORS.get("process")(AdvantageInputs(torch.zeros(2), 2), scale="group", eps=0.0,
                                            unbiased=True)

@pytest.mark.parametrize("call, exc, match", [
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
