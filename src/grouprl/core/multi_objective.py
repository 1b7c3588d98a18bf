"""Multi-objective aggregation: how the scores of K reward functions become advantages
(``MULTI_OBJECTIVE_AGGREGATIONS``, the config's ``multi_objective_aggregation``).

    "sum_then_normalize" (GRPO, the default): the weighted sum of the functions is the reward, and
      the advantage estimator (advantages.py; process_advantages.py for step rewards) normalises it.

    "normalize_then_sum": GDPO (Liu et al. 2026, "Group reward-Decoupled normalization Policy
      Optimization", arXiv 2601.05242, its method: decoupled normalisation), ``normalize_then_sum``:
      with K reward functions r_k,
        A_k = (r_k − mean_g(r_k)) / (std_g(r_k) + eps)     each function within its group
        S = Σ_k w_k·A_k,   A = (S − mean_batch(S)) / (std_batch(S) + eps)
      Summing first and normalising the sum (GRPO) lets the function with the largest spread decide
      the sign of most advantages; normalising first gives each function its own say. A function that
      returned None for a row (NaN) is left out of that group's mean and std and adds 0 to that row's
      S (TRL's nanmean/nansum); a row no function scored gets A = 0 and is left out of the batch
      statistics. scale="batch" divides each function by its own batch std instead, "none" only
      centres it. GDPO is its own group normalisation: it does not call the estimator (the config
      requires advantage_estimator grpo with it).

A registered aggregation is ``fn(inputs: AdvantageInputs, estimator, *, scale, eps, unbiased) -> Tensor``
with ``estimator`` the registered advantage estimator the config names. std is the sample standard
deviation when ``unbiased`` (TRL, verl); a group that is flat in every function gets exactly 0.
Worked numbers: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .advantages import AdvantageEstimator, AdvantageInputs, check_group_size, check_scale
from .registry import Registry

Aggregation = Callable[..., Tensor]  # fn(inputs, estimator, *, scale, eps, unbiased) -> Tensor
MULTI_OBJECTIVE_AGGREGATIONS: Registry[Aggregation] = Registry(
    "multi-objective aggregation", "grouprl.core.MULTI_OBJECTIVE_AGGREGATIONS.register")


@MULTI_OBJECTIVE_AGGREGATIONS.register("sum_then_normalize")
def sum_then_normalize(inputs: AdvantageInputs, estimator: AdvantageEstimator, *, scale: str = "group",
                       eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """The estimator's advantages of the summed rewards ([N], or [N, T] for a per-token estimator)."""
    return estimator(inputs, scale=scale, eps=eps, unbiased=unbiased)


@MULTI_OBJECTIVE_AGGREGATIONS.register("normalize_then_sum")
def _gdpo(inputs: AdvantageInputs, estimator: AdvantageEstimator, *, scale: str = "group", eps: float = 1e-4,
          unbiased: bool = True) -> Tensor:
    if inputs.per_func is None:
        raise ValueError("normalize_then_sum (GDPO) reads each reward function's scores: give AdvantageInputs "
                         "its per_func [N, K]")
    return normalize_then_sum(inputs.per_func, inputs.weights, inputs.group_size, scale=scale, eps=eps,
                              unbiased=unbiased)  # [N]


def normalize_then_sum(per_func: Tensor, weights: Tensor | list[float] | None, group_size: int, *,
                       scale: str = "group", eps: float = 1e-4, unbiased: bool = True) -> Tensor:
    """GDPO advantages [N] from ``per_func  # [N, K]`` (one column per reward function, NaN where it
    returned None) and ``weights  # [K]`` (None: all 1). See the module docstring."""
    check_scale(scale, eps)
    if not isinstance(per_func, Tensor) or per_func.dim() != 2:
        raise ValueError(f"per_func must be a [N, K] tensor (K reward functions), got "
                         f"{getattr(per_func, 'shape', type(per_func).__name__)}")
    n, k = per_func.shape
    check_group_size(n, group_size)
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
