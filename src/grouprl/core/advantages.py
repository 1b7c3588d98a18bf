"""Group-relative advantages: one number per completion from its reward and its group's.

Rewards arrive flat, ``rewards  # [N]`` with N = B·G, each prompt's G completions consecutive,
so ``rewards.view(B, G)`` is the group layout. The estimators (``ADVANTAGE_ESTIMATORS``; the math
with worked numbers is in docs/algorithms.md):

    GRPO,  scale="group":  A_i = (r_i − mean_g) / (std_g + eps)        DeepSeekMath §4.1.2
           scale="batch":  A_i = (r_i − mean_g) / (std_batch + eps)    LitePPO; TRL scale_rewards="batch"
    Dr. GRPO, "none":      A_i = r_i − mean_g                          arXiv 2503.20783 §3.2
    RLOO:                  A_i = r_i − mean_{j≠i} r_j = G/(G−1)·(r_i − mean_g)   Ahmadian et al. 2024

    REINFORCE++ (Hu et al. 2025, arXiv 2501.03262 v9, global advantage normalisation), "reinforce_pp":
        A_i = (r_i − mean_batch(r)) / (std_batch(r) + eps)
      the global batch is the baseline and the scale; no group. scale="none" keeps only the mean.

    REINFORCE++-baseline (same paper, "REINFORCE++ w/ Baseline"), "reinforce_pp_baseline":
        A'_i = r_i − mean_g(r),   A_i = (A'_i − mean_batch(A')) / (std_batch(A') + eps)
      the group mean removes the prompt's difficulty, the global batch std sets the scale. It differs
      from GRPO's scale="batch", which divides by the std of the raw rewards r: here the std is that
      of the group-centred A', which never counts the spread between prompts.

    GRPO pass@k (Tang et al. 2025, arXiv 2503.19595; verl's ``grpo_passk``), "grpo_passk": the
      leave-one-out estimator of the gradient of E[max over the group], k = G: only the group's best
      completion gets A = r_max − r_second_max, every other one 0 (a tie for the maximum gives 0).
      The first index wins a tie (verl: whatever torch.topk returns). scale="group" divides by the
      group std as verl does by default (norm_adv_by_std_in_grpo); the paper's estimator is
      unscaled, scale="none", which the grpo_passk preset follows.

std is the sample standard deviation (divide by n−1) when ``unbiased=True``, as TRL, verl,
OpenRLHF and oat do; ``unbiased=False`` divides by n. std_batch is taken over all N rewards.

One registry for every estimator the config can name. A registered estimator is
``fn(inputs: AdvantageInputs, *, scale, eps, unbiased) -> Tensor``: ``AdvantageInputs`` is the scored
batch as plain values (the summed rewards, each reward function's scores, the process steps), and
each estimator reads what it needs. The estimators above read ``inputs.rewards`` only and are
written (and registered with ``register_advantage_estimator``) as ``fn(rewards, group_size, ...)``;
"process" (process_advantages.py) reads the step rewards and returns one advantage per token
[N, T]. How several reward functions meet the estimator is the second, independent choice,
``MULTI_OBJECTIVE_AGGREGATIONS`` (multi_objective.py): GRPO's default sums them and calls the
estimator, GDPO normalises each function itself. Two registries because the config makes two
independent choices (``advantage_estimator``, ``multi_objective_aggregation``); no ``if`` picks
between process, GDPO and the outcome estimators.

Deliberate choices:
- A group whose rewards are all exactly equal gets advantage exactly 0 (no 0/0, no eps noise),
  whatever the scale; ``zero_std_groups`` reports those groups (metric, DAPO dynamic sampling).
  REINFORCE++ has no group, so its groups are not zeroed.
- ``compute_advantages("rloo", ..., scale=...)`` applies the same std scaling to the
  leave-one-out advantage; scale="none" (the rloo preset) is plain RLOO.
- verl computes both REINFORCE++ forms per token and whitens over the batch's tokens, which weights
  each completion by its length; with one reward per completion and the KL in the loss (not in the
  reward) we whiten over completions, as the paper's per-sample formula reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import Registry

SCALES = ("group", "batch", "none")


@dataclass(frozen=True, eq=False)
class AdvantageInputs:
    """A scored batch as plain values: what an advantage estimator may read."""

    rewards: Tensor                           # [N] weighted sum of the reward functions (+ shaping)
    group_size: int                           # G; each prompt's G completions are consecutive
    per_func: Tensor | None = None            # [N, K] each reward function's score, NaN where it abstained
    weights: Sequence[float] | None = None    # [K] reward weights (None: all 1)
    step_rewards: Sequence[Sequence[float]] | None = None  # [N][K_i] process steps (the outcome the last)
    step_ends: Sequence[Sequence[int]] | None = None       # [N][K_i] token index of each step's last token
    num_tokens: int | None = None             # T, the completions' padded length (per-token estimators)
    values: Tensor | None = None              # [N, T] a value function's estimates V_old (gae, gae.py)
    token_mask: Tensor | None = None          # [N, T] bool: the action tokens (gae's steps)
    gamma: float = 1.0                        # gae's discount
    lam: float = 1.0                          # gae's λ


AdvantageEstimator = Callable[..., Tensor]  # fn(inputs: AdvantageInputs, *, scale, eps, unbiased) -> Tensor
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "grouprl.core.register_advantage_estimator")


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register an estimator of the summed rewards,
    ``fn(rewards [N], group_size, *, scale, eps, unbiased) -> Tensor[N]``; ``fn`` is returned as is.
    An estimator that reads more of the batch registers ``fn(inputs: AdvantageInputs, *, scale, eps,
    unbiased)`` with ``ADVANTAGE_ESTIMATORS.register(name)``."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        def estimator(inputs: AdvantageInputs, *, scale: str, eps: float, unbiased: bool) -> Tensor:
            return fn(inputs.rewards, inputs.group_size, scale=scale, eps=eps, unbiased=unbiased)  # [N]

        estimator.__name__ = estimator.__qualname__ = getattr(fn, "__name__", name)
        estimator.__doc__ = fn.__doc__
        ADVANTAGE_ESTIMATORS.register(name)(estimator)
        return fn

    return decorator


def check_group_size(n: int, group_size: int) -> None:
    """Every estimator's check that ``n`` rows split into groups of ``group_size`` >= 2."""
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
    check_group_size(rewards.shape[0], group_size)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    bad = ~torch.isfinite(rewards)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"rewards[{i}] = {rewards[i].item()} is not finite: fix the reward function "
                         "(return a finite float for every completion)")
    return rewards.view(-1, group_size)  # [B, G]


def check_scale(scale: str, eps: float) -> None:
    """Every estimator's check of its ``scale`` (``SCALES``) and ``eps``."""
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
    check_scale(scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # [B, G]
    return _scaled(centered, grouped, scale, eps, unbiased)


@register_advantage_estimator("rloo")
def _rloo_estimator(rewards: Tensor, group_size: int, *, scale: str = "none", eps: float = 1e-4,
                    unbiased: bool = True) -> Tensor:
    check_scale(scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    loo_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
    return _scaled(grouped - loo_mean, grouped, scale, eps, unbiased)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages [N]: each reward minus the mean of the other G−1 rewards of its group."""
    return _rloo_estimator(rewards, group_size, scale="none")


def _whiten(x: Tensor, eps: float, unbiased: bool, scale: bool) -> Tensor:
    """(x − mean) / (std + eps) over all of x [N] (only the centring when not ``scale``); all-equal x
    becomes exactly 0, as an all-equal group does (with eps 0 it was 0/0: NaN)."""
    centered = x - x.mean()
    if not scale or x.numel() < 2:
        return centered
    scaled = centered / (x.std(correction=1 if unbiased else 0) + eps)
    return torch.where((x == x[:1]).all(), torch.zeros_like(scaled), scaled)


def _batch_scale(scale: str, name: str) -> bool:
    if scale == "group":
        raise ValueError(f"{name} normalises over the whole batch: use scale 'batch' (the paper's) or "
                         "'none' (centre only), not 'group'")
    return scale == "batch"


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, group_size: int, *, scale: str = "batch", eps: float = 1e-4,
                            unbiased: bool = True) -> Tensor:
    """REINFORCE++ advantages [N]: rewards [N] whitened over the batch (module docstring)."""
    check_scale(scale, eps)
    divide = _batch_scale(scale, "reinforce_pp")
    return _whiten(_grouped(rewards, group_size).reshape(-1), eps, unbiased, divide)  # [N]


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: Tensor, group_size: int, *, scale: str = "batch",
                                     eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """REINFORCE++-baseline advantages [N]: group-centred, then whitened over the batch."""
    check_scale(scale, eps)
    divide = _batch_scale(scale, "reinforce_pp_baseline")
    grouped = _grouped(rewards, group_size)  # [B, G]
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # [N]
    adv = _whiten(centered, eps, unbiased, divide).view_as(grouped)  # [B, G]
    return torch.where(_all_equal(grouped)[:, None], torch.zeros_like(adv), adv).reshape(-1)  # [N]


@register_advantage_estimator("grpo_passk")
def passk_advantages(rewards: Tensor, group_size: int, *, scale: str = "none", eps: float = 1e-4,
                     unbiased: bool = True) -> Tensor:
    """GRPO pass@k advantages [N]: r_max − r_second_max on each group's best completion, else 0."""
    check_scale(scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    top2 = grouped.topk(2, dim=1).values  # [B, 2]
    best = (grouped == top2[:, :1]).int().argmax(dim=1)  # [B] first index of the maximum
    gap = top2[:, 0] - top2[:, 1]  # [B]
    correction = 1 if unbiased else 0
    if scale == "group":
        gap = gap / (grouped.std(dim=1, correction=correction) + eps)
    elif scale == "batch":
        gap = gap / (grouped.std(correction=correction) + eps)
    gap = torch.where(top2[:, 0] == top2[:, 1], torch.zeros_like(gap), gap)  # no gap: 0, not 0/0 with eps 0
    adv = torch.zeros_like(grouped).scatter_(1, best[:, None], gap[:, None])  # [B, G]
    return adv.reshape(-1)  # [N]


def compute_advantages(estimator: str, rewards: Tensor, group_size: int, *, scale: str = "group",
                       eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """Advantages [N] of ``rewards  # [N]`` by the registered estimator ``estimator`` ("grpo", "rloo", ...)."""
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    return fn(AdvantageInputs(rewards, group_size), scale=scale, eps=eps, unbiased=unbiased)  # [N]


