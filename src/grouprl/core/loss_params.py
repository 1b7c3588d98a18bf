"""The knobs of ``policy_loss`` as one ``LossParams``, validated once, and the two registries its
names index: ``RATIO_LEVELS`` (the ratio ρ, token or sequence level, filled by policy_loss.py) and
``LOSS_TYPES`` (the per-token policy term, filled by policy_terms.py). Formulas: docs/algorithms.md.

It sits below both modules so that they import one way: policy_loss.py imports policy_terms.py (the
terms it calls), and both import this module, which imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from .aggregation import LOSS_AGGREGATIONS
from .kl import KL_ESTIMATORS
from .registry import Registry

RatioFn = Callable[[Tensor, Tensor, Tensor], Tensor]
RATIO_LEVELS: Registry[RatioFn] = Registry("ratio level", "grouprl.core.register_ratio_level")
LossTypeFn = Callable[[Tensor, Tensor, Tensor, "LossParams"], tuple[Tensor, dict[str, Tensor]]]
LOSS_TYPES: Registry[LossTypeFn] = Registry("policy term", "grouprl.core.register_loss_type")


def register_ratio_level(name: str) -> Callable[[RatioFn], RatioFn]:
    """Decorator: register ``fn(logp, old_logp, mask) -> ratio [N, T]`` (inputs already zero on padding)."""
    return RATIO_LEVELS.register(name)


def register_loss_type(name: str) -> Callable[[LossTypeFn], LossTypeFn]:
    """Decorator: register ``fn(logp, ratio, adv, params) -> (per_token [N, T], flags)``.

    logp  # [N, T] log π_θ (with gradient); ratio  # [N, T] ρ (with gradient); adv  # [N, T]
    detached advantages; all three are zero / one on padding. ``params`` is a ``LossParams`` (each
    term reads its own knobs). ``flags`` maps a stat name to a bool [N, T] tensor; policy_loss
    reports the fraction of real tokens where it is True."""
    return LOSS_TYPES.register(name)


@dataclass(frozen=True)
class LossParams:
    """Every knob of ``policy_loss``, as plain values, validated once at construction.

    eps_low/eps_high bound the clip (and cispo's IS weight); eps_high=None means eps_low.
    ratio_level (``RATIO_LEVELS``), agg (``LOSS_AGGREGATIONS``; max_tokens is L_max for
    seq-mean-token-sum-norm), beta and kl_kind (``KL_ESTIMATORS``) the KL penalty, dual_clip and delta
    the clip's caps, loss_type the policy term (``LOSS_TYPES``), sapo_tau_pos/neg SAPO's temperatures.
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    ratio_level: str = "token"
    agg: str = "seq-mean-token-mean"
    max_tokens: int | None = None
    beta: float = 0.0
    kl_kind: str = "k3"
    dual_clip: float | None = None
    delta: float | None = None
    loss_type: str = "clip"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self) -> None:
        RATIO_LEVELS.get(self.ratio_level, "ratio_level")
        LOSS_TYPES.get(self.loss_type, "loss_type")
        LOSS_AGGREGATIONS.get(self.agg, "agg")
        KL_ESTIMATORS.get(self.kl_kind, "kl_kind")
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", self.eps_low)
        if self.eps_low < 0 or self.eps_high < 0:
            raise ValueError(f"eps_low={self.eps_low}, eps_high={self.eps_high}: clip ranges must be >= 0")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta} must be >= 0 (0 disables the KL penalty)")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 (typical 3) or None")
        if self.delta is not None and self.delta <= 1:
            raise ValueError(f"delta={self.delta} must be > 1 (INTELLECT-2 uses 4) or None")
        if self.loss_type != "clip" and (self.dual_clip is not None or self.delta is not None
                                         or self.ratio_level != "token"):
            raise ValueError(f"loss_type={self.loss_type!r} acts on token ratios without the PPO clip: dual_clip, "
                             "delta and ratio_level='sequence' apply to loss_type='clip' only; drop them")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"sapo_tau_pos={self.sapo_tau_pos}, sapo_tau_neg={self.sapo_tau_neg} must be > 0 "
                             "(SAPO uses 1.0 and 1.05)")
