"""More advantage estimators (registered in ``ADVANTAGE_ESTIMATORS``) and GDPO's multi-reward
aggregation. Rewards arrive flat, ``rewards  # [N]``, each prompt's G completions consecutive.

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

    GDPO (Liu et al. 2026, "Group reward-Decoupled normalization Policy Optimization",
      arXiv 2601.05242, its method: decoupled normalisation), ``normalize_then_sum``: with K reward
      functions r_k,
        A_k = (r_k − mean_g(r_k)) / (std_g(r_k) + eps)     each function within its group
        S = Σ_k w_k·A_k,   A = (S − mean_batch(S)) / (std_batch(S) + eps)
      Summing first and normalising the sum (the default, GRPO) lets the function with the largest
      spread decide the sign of most advantages; normalising first gives each function its own say.
      A function that returned None for a row (NaN) is left out of that group's mean and std and adds
      0 to that row's S (TRL's nanmean/nansum); a row no function scored gets A = 0 and is left out
      of the batch statistics. scale="batch" divides each function by its own batch std instead,
      "none" only centres it.

std is the sample standard deviation when ``unbiased`` (TRL, verl). As in advantages.py, a group
whose rewards are all exactly equal gets exactly 0 from the group-baseline estimators (for GDPO: a
group that is flat in every function); REINFORCE++ has no group, so its groups are not zeroed.
verl computes both REINFORCE++ forms per token and whitens over the batch's tokens, which weights
each completion by its length; with one reward per completion and the KL in the loss (not in the
reward) we whiten over completions, as the paper's per-sample formula reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import _all_equal, _check_group_size, _check_scale, _grouped, register_advantage_estimator


def _whiten(x: Tensor, eps: float, unbiased: bool, scale: bool) -> Tensor:
    """(x − mean) / (std + eps) over all of x [N] (only the centring when not ``scale``)."""
    centered = x - x.mean()
    if not scale or x.numel() < 2:
        return centered
    return centered / (x.std(correction=1 if unbiased else 0) + eps)


def _batch_scale(scale: str, name: str) -> bool:
    if scale == "group":
        raise ValueError(f"{name} normalises over the whole batch: use scale 'batch' (the paper's) or "
                         "'none' (centre only), not 'group'")
    return scale == "batch"


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, group_size: int, *, scale: str = "batch", eps: float = 1e-4,
                            unbiased: bool = True) -> Tensor:
    """REINFORCE++ advantages [N]: rewards [N] whitened over the batch (module docstring)."""
    _check_scale(scale, eps)
    divide = _batch_scale(scale, "reinforce_pp")
    return _whiten(_grouped(rewards, group_size).reshape(-1), eps, unbiased, divide)  # [N]


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: Tensor, group_size: int, *, scale: str = "batch",
                                     eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """REINFORCE++-baseline advantages [N]: group-centred, then whitened over the batch."""
    _check_scale(scale, eps)
    divide = _batch_scale(scale, "reinforce_pp_baseline")
    grouped = _grouped(rewards, group_size)  # [B, G]
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # [N]
    adv = _whiten(centered, eps, unbiased, divide).view_as(grouped)  # [B, G]
    return torch.where(_all_equal(grouped)[:, None], torch.zeros_like(adv), adv).reshape(-1)  # [N]


@register_advantage_estimator("grpo_passk")
def passk_advantages(rewards: Tensor, group_size: int, *, scale: str = "none", eps: float = 1e-4,
                     unbiased: bool = True) -> Tensor:
    """GRPO pass@k advantages [N]: r_max − r_second_max on each group's best completion, else 0."""
    _check_scale(scale, eps)
    grouped = _grouped(rewards, group_size)  # [B, G]
    top2 = grouped.topk(2, dim=1).values  # [B, 2]
    best = (grouped == top2[:, :1]).int().argmax(dim=1)  # [B] first index of the maximum
    gap = top2[:, 0] - top2[:, 1]  # [B]
    correction = 1 if unbiased else 0
    if scale == "group":
        gap = gap / (grouped.std(dim=1, correction=correction) + eps)
    elif scale == "batch":
        gap = gap / (grouped.std(correction=correction) + eps)
    adv = torch.zeros_like(grouped).scatter_(1, best[:, None], gap[:, None])  # [B, G]
    return adv.reshape(-1)  # [N]


def normalize_then_sum(per_func: Tensor, weights: Tensor | list[float] | None, group_size: int, *,
                       scale: str = "group", eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """GDPO advantages [N] from ``per_func  # [N, K]`` (one column per reward function, NaN where it
    returned None) and ``weights  # [K]`` (None: all 1). See the module docstring."""
    _check_scale(scale, eps)
    if not isinstance(per_func, Tensor) or per_func.dim() != 2:
        raise ValueError(f"per_func must be a [N, K] tensor (K reward functions), got "
                         f"{getattr(per_func, 'shape', type(per_func).__name__)}")
    n, k = per_func.shape
    _check_group_size(n, group_size)
    w = torch.ones(k, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (k,):
        raise ValueError(f"{w.numel()} weights for {k} reward functions: give one weight per function")
    x = per_func.double()  # [N, K]
    if torch.isinf(x).any():
        raise ValueError("per_func holds inf: every reward must be finite (NaN marks a missing score)")
    present = ~torch.isnan(x)  # [N, K]
    correction = 1 if unbiased else 0
    g = x.view(-1, group_size, k)  # [B, G, K]
    p = present.view_as(g)
    zero = x.new_zeros(())
    count = p.sum(1, keepdim=True)  # [B, 1, K]
    mean = torch.where(p, g, zero).sum(1, keepdim=True) / count.clamp(min=1)  # [B, 1, K]
    centered = torch.where(p, g - mean, zero)  # [B, G, K]
    if scale == "group":
        var = centered.square().sum(1, keepdim=True) / (count - correction).clamp(min=1)  # [B, 1, K]
        centered = centered / (var.sqrt() + eps)
    elif scale == "batch":
        flat = torch.where(present, x, zero)  # [N, K]
        n_k = present.sum(0)  # [K]
        mean_k = flat.sum(0) / n_k.clamp(min=1)
        var_k = torch.where(present, x - mean_k, zero).square().sum(0) / (n_k - correction).clamp(min=1)
        centered = centered / (var_k.sqrt() + eps)
    hi = torch.where(p, g, -torch.inf).amax(1, keepdim=True)  # [B, 1, K]
    lo = torch.where(p, g, torch.inf).amin(1, keepdim=True)
    centered = torch.where(hi <= lo, zero, centered)  # a flat (or single-score) group gives 0
    s = (centered * w).sum(-1).reshape(-1)  # [N]
    scored = present.any(-1)  # [N]
    if not scored.any():
        return torch.zeros(n, dtype=torch.float32)
    mean_s = s[scored].mean()
    std_s = s[scored].std(correction=correction) if int(scored.sum()) > 1 else zero
    adv = (s - mean_s) / (std_s + eps)  # [N]
    no_signal = (s.view(-1, group_size) == 0).all(1).repeat_interleave(group_size)  # [N]
    return torch.where(scored & ~no_signal, adv, zero).float()  # [N]
