"""Process-supervision advantages (DeepSeekMath §4.1.3): one advantage per token from step rewards.

Completion i has steps j with reward r_i^(j) ending at token index(j). Normalise over all step
rewards R of the group, r̃ = (r − mean(R)) / (std(R) + eps), and give token t the sum of the
normalised rewards of the steps ending at or after it:

    A_{i,t} = Σ_{index(j) ≥ t} r̃_i^(j)

computed as a scatter at the step ends and a reverse cumsum. ``scale`` works as for outcome rewards
(advantages.py): "group" is the paper's std(R), "batch" the std of every step reward in the batch,
"none" only centres. With one step per completion, at its last token, this is outcome supervision:
every token of completion i gets group_advantages(...)_i (§4.1.2). Worked numbers: docs/algorithms.md.

Registered as the advantage estimator "process": it reads ``AdvantageInputs.step_rewards`` /
``step_ends`` (rewards/process.py maps the reward functions' steps to token indices and adds the
outcome reward as a final step) and ``num_tokens``, and returns [N, T].

Deliberate choices:
- The paper divides by std(R) without eps; we add eps as for outcome rewards.
- A group whose step rewards are all exactly equal (a single step included) gets exactly 0;
  ``zero_std_step_groups`` reports those groups (dynamic sampling, the prompt filter). A group whose
  completions have equal mean step rewards but unequal steps is not flat: its advantages are not 0.
- Computed in float64 (a handful of numbers), returned as float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, check_group_size, check_scale


def zero_std_step_groups(step_rewards: Sequence[Sequence[float]], group_size: int) -> Tensor:
    """Bool [B]: True for each group whose step rewards are all exactly equal, or that has none: the
    groups ``process_advantages`` gives exactly 0 (no learning signal)."""
    check_group_size(len(step_rewards), group_size)
    groups = [[float(x) for r in step_rewards[g:g + group_size] for x in r]
              for g in range(0, len(step_rewards), group_size)]
    return torch.tensor([all(x == g[0] for x in g) for g in groups], dtype=torch.bool)  # [B]


def process_advantages(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                       group_size: int, num_tokens: int, *, scale: str = "group", eps: float = 1e-4,
                       unbiased: bool = True) -> Tensor:
    """Process-supervision advantages [N, T] (T = num_tokens), DeepSeekMath §4.1.3.

    ``step_rewards[i]`` are the rewards of completion i's steps, ``step_ends[i]`` the 0-based
    inclusive index of each step's last token. Tokens after the last step end get 0.
    Computed in float64 (a handful of numbers), returned as float32.
    """
    n = len(step_rewards)
    check_group_size(n, group_size)
    if len(step_ends) != n:
        raise ValueError(f"step_ends has {len(step_ends)} entries but step_rewards has {n}: "
                         "give one list of step ends per completion")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r} must be a positive int (completion length T)")
    check_scale(scale, eps)
    rows: list[int] = []
    for i, (r_i, e_i) in enumerate(zip(step_rewards, step_ends)):
        if len(r_i) != len(e_i):
            raise ValueError(f"completion {i}: {len(r_i)} step rewards but {len(e_i)} step ends; "
                             "give one end index per step")
        rows.extend([i] * len(r_i))
    row = torch.tensor(rows, dtype=torch.long)  # [K] completion of each step
    r = torch.tensor([float(x) for r_i in step_rewards for x in r_i], dtype=torch.float64)  # [K]
    end = torch.tensor([int(x) for e_i in step_ends for x in e_i], dtype=torch.long)  # [K]
    if not torch.isfinite(r).all():
        raise ValueError("step_rewards contain NaN or inf: every step reward must be a finite float")
    if ((end < 0) | (end >= num_tokens)).any():
        raise ValueError(f"step_ends must lie in [0, num_tokens={num_tokens}); got "
                         f"min {int(end.min())}, max {int(end.max())}")

    b = n // group_size
    group = row // group_size  # [K]
    count = r.new_zeros(b).index_add_(0, group, torch.ones_like(r))  # [B] steps per group
    mean = r.new_zeros(b).index_add_(0, group, r) / count.clamp(min=1)  # [B]
    centered = r - mean[group]  # [K]
    sq = r.new_zeros(b).index_add_(0, group, centered**2)  # [B]
    std = (sq / (count - (1 if unbiased else 0)).clamp(min=1)).sqrt()  # [B]
    if scale == "batch":  # one std over every step reward of the batch
        std = (r - r.mean()).pow(2).sum().div(max(len(r) - (1 if unbiased else 0), 1)).sqrt().expand(b)  # [B]
    denom = std[group] + eps if scale != "none" else torch.ones_like(r)  # [K]
    flat = zero_std_step_groups(step_rewards, group_size)[group]  # [K] step of an all-equal group (or a single step)
    r_norm = torch.where(flat, torch.zeros_like(r), centered / denom)  # [K]

    at_end = r.new_zeros(n, num_tokens).index_put_((row, end), r_norm, accumulate=True)  # [N, T]
    return at_end.flip(1).cumsum(1).flip(1).float()  # [N, T]: A_{i,t} = Σ_{end_j ≥ t} r̃_j


@ADVANTAGE_ESTIMATORS.register("process")
def _process_estimator(inputs: AdvantageInputs, *, scale: str, eps: float, unbiased: bool) -> Tensor:
    if inputs.step_rewards is None or inputs.step_ends is None or inputs.num_tokens is None:
        raise ValueError("advantage estimator 'process' reads step rewards: give AdvantageInputs its "
                         "step_rewards, step_ends and num_tokens (rewards/process.py builds the steps)")
    return process_advantages(inputs.step_rewards, inputs.step_ends, inputs.group_size, inputs.num_tokens,
                              scale=scale, eps=eps, unbiased=unbiased)  # [N, T]
