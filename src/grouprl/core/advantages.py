"""Group-relative advantages: one number per completion (or per token, for process rewards).

Rewards arrive flat, ``rewards  # [N]`` with N = B·G, each prompt's G completions consecutive,
so ``rewards.view(B, G)`` is the group layout.

    GRPO,  scale="group":  A_i = (r_i − mean_g) / (std_g + eps)        DeepSeekMath §4.1.2
           scale="batch":  A_i = (r_i − mean_g) / (std_batch + eps)    LitePPO; TRL scale_rewards="batch"
    Dr. GRPO, "none":      A_i = r_i − mean_g                          arXiv 2503.20783 §3.2
    RLOO:                  A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean_g)   Ahmadian et al. 2024

std is the sample standard deviation (divide by n−1) when ``unbiased=True``, as TRL, verl,
OpenRLHF and oat do; ``unbiased=False`` divides by n. std_batch is taken over all N rewards.

Process supervision (DeepSeekMath §4.1.3): completion i has steps j with reward r_i^(j) ending
at token index(j). Normalise over all step rewards R of the group, r̃ = (r − mean(R)) / (std(R) + eps),
and give token t the sum of the normalised rewards of the steps ending at or after it:
A_{i,t} = Σ_{index(j) ≥ t} r̃_i^(j).  Computed as a scatter at the step ends and a reverse cumsum.
``scale`` works as for outcome rewards: "group" is the paper's std(R), "batch" the std of every step
reward in the batch, "none" only centres. With one step per completion, at its last token, this is
outcome supervision: every token of completion i gets group_advantages(...)_i (§4.1.2).

Deliberate choices:
- A group whose rewards are all exactly equal gets advantage exactly 0 (no 0/0, no eps noise),
  whatever the scale; ``zero_std_groups`` reports those groups (metric, DAPO dynamic sampling).
- The paper divides by std(R) without eps; we add eps as for outcome rewards.
- ``compute_advantages("rloo", ..., scale=...)`` applies the same std scaling to the
  leave-one-out advantage; scale="none" (the rloo preset) is plain RLOO.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")

AdvantageEstimator = Callable[..., Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register ``fn(rewards, group_size, *, scale, eps, unbiased) -> Tensor[N]``."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered; pick another name")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def _check_group_size(n: int, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size={group_size!r} must be an int (completions per prompt)")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO needs at least 2 completions per prompt "
                         "to form a group baseline; use group_size >= 2")
    if n == 0 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of group_size={group_size}: pass "
                         "B·G rewards with each prompt's G completions consecutive")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate flat rewards [N] and return them as float groups [B, G]."""
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor of shape [N], got {type(rewards).__name__}; "
                        "wrap it with torch.tensor(rewards)")
    if rewards.dim() != 1:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; pass a flat [N] tensor "
                         "(N = prompts × group_size, groups consecutive)")
    _check_group_size(rewards.shape[0], group_size)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    bad = ~torch.isfinite(rewards)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"rewards[{i}] = {rewards[i].item()} is not finite: fix the reward function "
                         "(return a finite float for every completion)")
    return rewards.view(-1, group_size)  # [B, G]


def _check_scale(scale: str, eps: float) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is unknown; use one of {SCALES}")
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")


def _scaled(centered: Tensor, grouped: Tensor, scale: str, eps: float, unbiased: bool) -> Tensor:
    """Divide centered advantages [B, G] by the chosen std; all-equal groups become exactly 0."""
    correction = 1 if unbiased else 0
    if scale == "group":
        centered = centered / (grouped.std(dim=1, correction=correction, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (grouped.std(correction=correction) + eps)
    flat = _all_equal(grouped)  # [B]
    return torch.where(flat[:, None], torch.zeros_like(centered), centered).reshape(-1)  # [N]


def _all_equal(grouped: Tensor) -> Tensor:
    return (grouped == grouped[:, :1]).all(dim=1)  # [B]


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Bool [B]: True for each group whose G rewards are all exactly equal (no learning signal)."""
    return _all_equal(_grouped(rewards, group_size))


@register_advantage_estimator("grpo")
def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4,
                     unbiased: bool = True) -> Tensor:
    """GRPO / Dr. GRPO advantages [N] from rewards [N] (see module docstring for ``scale``)."""
    _check_scale(scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [B, G]
    return _scaled(centered, grouped, scale, eps, unbiased)


@register_advantage_estimator("rloo")
def _rloo_estimator(rewards: Tensor, group_size: int, *, scale: str = "none", eps: float = 1e-4,
                    unbiased: bool = True) -> Tensor:
    _check_scale(scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    loo_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
    return _scaled(grouped - loo_mean, grouped, scale, eps, unbiased)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages [N]: each reward minus the mean of the other G−1 rewards of its group."""
    return _rloo_estimator(rewards, group_size, scale="none")


def compute_advantages(estimator: str, rewards: Tensor, group_size: int, *, scale: str = "group",
                       eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """Dispatch to the registered estimator ``estimator`` ("grpo", "rloo", ...); returns [N]."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is unknown; use one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)} or register_advantage_estimator a new one")
    return ADVANTAGE_ESTIMATORS[estimator](rewards, group_size, scale=scale, eps=eps, unbiased=unbiased)


def process_advantages(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                       group_size: int, num_tokens: int, *, scale: str = "group", eps: float = 1e-4,
                       unbiased: bool = True) -> Tensor:
    """Process-supervision advantages [N, T] (T = num_tokens), DeepSeekMath §4.1.3.

    ``step_rewards[i]`` are the rewards of completion i's steps, ``step_ends[i]`` the 0-based
    inclusive index of each step's last token. Tokens after the last step end get 0.
    Computed in float64 (a handful of numbers), returned as float32.
    """
    n = len(step_rewards)
    _check_group_size(n, group_size)
    if len(step_ends) != n:
        raise ValueError(f"step_ends has {len(step_ends)} entries but step_rewards has {n}: "
                         "give one list of step ends per completion")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r} must be a positive int (completion length T)")
    _check_scale(scale, eps)
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
    r_max = r.new_full((b,), -torch.inf).scatter_reduce_(0, group, r, "amax")
    r_min = r.new_full((b,), torch.inf).scatter_reduce_(0, group, r, "amin")
    flat = (r_max == r_min)[group]  # [K] step belongs to an all-equal group (incl. a single step)
    r_norm = torch.where(flat, torch.zeros_like(r), centered / denom)  # [K]

    at_end = r.new_zeros(n, num_tokens).index_put_((row, end), r_norm, accumulate=True)  # [N, T]
    return at_end.flip(1).cumsum(1).flip(1).float()  # [N, T]: A_{i,t} = Σ_{end_j ≥ t} r̃_j
