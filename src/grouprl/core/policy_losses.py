"""Per-token policy-gradient terms of the GRPO family (``LOSS_TYPES``), one registered function each.

``policy_loss`` (losses.py) computes the ratio ρ (token or sequence level, ``RATIO_LEVELS``), then
calls the loss type for the per-token term ℓ_{i,t}, then applies the token weights, adds β·KL and
aggregates. Every loss type sees padding already zeroed (A = 0 and logp = old there, so ρ = 1).

    "clip"  PPO clip (Schulman et al. 2017; GRPO, DeepSeekMath eq. 3):
            ℓ = max(−A·min(ρ, δ), −A·clip(ρ, 1−ε_low, 1+ε_high))
            dual clip (Ye et al. 2020), tokens with A < 0:  ℓ = min(ℓ, −c·A)
            δ (INTELLECT-2 two-sided cap): the unclipped term uses min(ρ, δ)
            Tokens whose clipped branch is active get no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossParams:
    """Plain hyper-parameters a loss type may read (each type uses its own)."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    delta: float | None = None


LossTypeFn = Callable[[Tensor, Tensor, Tensor, LossParams], tuple[Tensor, dict[str, Tensor]]]
LOSS_TYPES: dict[str, LossTypeFn] = {}


def register_loss_type(name: str) -> Callable[[LossTypeFn], LossTypeFn]:
    """Decorator: register ``fn(logp, ratio, adv, params) -> (per_token [N, T], flags)``.

    logp  # [N, T] log π_θ (with gradient); ratio  # [N, T] ρ (with gradient); adv  # [N, T]
    detached advantages; all three are zero / one on padding. ``flags`` maps a stat name to a bool
    [N, T] tensor; policy_loss reports the fraction of real tokens where it is True."""

    def decorator(fn: LossTypeFn) -> LossTypeFn:
        if name in LOSS_TYPES:
            raise ValueError(f"loss type {name!r} is already registered; pick another name")
        LOSS_TYPES[name] = fn
        return fn

    return decorator


@register_loss_type("clip")
def clip_loss(logp: Tensor, ratio: Tensor, adv: Tensor, p: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate (module docstring); flags ``dual_clip_frac`` when dual_clip is set."""
    ratio_unclipped = ratio if p.delta is None else ratio.clamp(max=p.delta)
    pg_unclipped = -adv * ratio_unclipped  # [N, T]
    pg_clipped = -adv * ratio.clamp(1 - p.eps_low, 1 + p.eps_high)  # [N, T]
    per_token = torch.maximum(pg_unclipped, pg_clipped)  # [N, T]
    flags: dict[str, Tensor] = {}
    if p.dual_clip is not None:
        cap = -p.dual_clip * adv  # [N, T]
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
        flags["dual_clip_frac"] = dual_active
    return per_token, flags
