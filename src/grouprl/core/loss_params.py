"""The knobs of ``policy_loss`` as one ``LossParams``, validated once, and the two registries its
names index: ``RATIO_LEVELS`` (the ratio ρ, token or sequence level, filled by policy_loss.py) and
``LOSS_TYPES`` (the per-token policy term, filled by policy_terms.py). Formulas: docs/algorithms.md.

It sits below both modules so that they import one way: policy_loss.py imports policy_terms.py (the
terms it calls), and both import this module, which imports neither.
"""

from __future__ import annotations

import math
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


_PER_SEQUENCE_TERMS: set[str] = set()  # loss types that form their own ratio per completion


def register_loss_type(name: str, *, per_sequence: bool = False) -> Callable[[LossTypeFn], LossTypeFn]:
    """Decorator: register ``fn(logp, ratio, adv, params) -> (per_token [N, T], flags)``.

    logp  # [N, T] log π_θ (with gradient); ratio  # [N, T] ρ (with gradient); adv  # [N, T]
    detached advantages; all three are zero / one on padding. ``params`` is a ``LossParams`` (each
    term reads its own knobs). ``flags`` maps a stat name to a bool [N, T] tensor; policy_loss
    reports the fraction of real tokens where it is True (a flag named like one of policy_loss's
    own stats, ``clip_frac_low`` say, replaces it).

    ``per_sequence=True``: the term forms its own ratio per completion from the token log-ratios
    (GMPO's geometric mean), so it is also given the keywords ``mask`` (bool [N, T], the real
    tokens) and ``log_ratio`` ([N, T] logp − old, zero on padding, with gradient)."""
    def decorator(fn: LossTypeFn) -> LossTypeFn:
        LOSS_TYPES.register(name)(fn)
        if per_sequence:
            _PER_SEQUENCE_TERMS.add(name)
        else:
            _PER_SEQUENCE_TERMS.discard(name)
        return fn

    return decorator


def is_per_sequence(loss_type: str) -> bool:
    """Whether ``loss_type`` was registered with ``per_sequence=True`` (it takes ``mask`` and ``log_ratio``)."""
    return loss_type in _PER_SEQUENCE_TERMS


@dataclass(frozen=True)
class LossParams:
    """Every knob of ``policy_loss``, as plain values, validated once at construction.

    eps_low/eps_high bound the clip (and cispo's IS weight); eps_high=None means eps_low.
    ratio_level (``RATIO_LEVELS``), agg (``LOSS_AGGREGATIONS``; max_tokens is L_max for
    seq-mean-token-sum-norm), beta and kl_kind (``KL_ESTIMATORS``) the KL penalty, dual_clip and delta
    the clip's caps, loss_type the policy term (``LOSS_TYPES``), sapo_tau_pos/neg SAPO's temperatures,
    entropy_coef c of the entropy bonus −c·H (0: off; policy_loss then needs no entropy).
    The values are checked by ``check_loss_settings``, whose messages name the config's fields.
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
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        RATIO_LEVELS.get(self.ratio_level, "ratio_level")
        LOSS_TYPES.get(self.loss_type, "loss_type")
        LOSS_AGGREGATIONS.get(self.agg, "agg")
        KL_ESTIMATORS.get(self.kl_kind, "kl_kind")
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", self.eps_low)
        check_loss_settings(epsilon=self.eps_low, epsilon_high=self.eps_high, beta=self.beta, dual_clip=self.dual_clip,
                            delta=self.delta, loss_type=self.loss_type, importance_sampling_level=self.ratio_level,
                            sapo_temperature_pos=self.sapo_tau_pos, sapo_temperature_neg=self.sapo_tau_neg,
                            entropy_coef=self.entropy_coef)


def check_loss_settings(*, epsilon: float, epsilon_high: float, beta: float, dual_clip: float | None,
                        delta: float | None, loss_type: str, importance_sampling_level: str,
                        sapo_temperature_pos: float, sapo_temperature_neg: float, entropy_coef: float = 0.0) -> None:
    """ValueError unless these loss settings are valid, the one place they are checked. They are
    spelled as the config spells them (``LossParams``' eps_low is ``epsilon``, ratio_level
    ``importance_sampling_level``, sapo_tau_pos/neg ``sapo_temperature_pos/neg``), so that config
    validation, which raises this message as a ConfigError, and ``LossParams`` say the same thing.
    The config refuses more on top: values the math takes but a run should not (epsilon of 0 or
    of 1 and more, delta within the clip range)."""
    if epsilon < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon={epsilon}, epsilon_high={epsilon_high}: clip ranges must be >= 0")
    if beta < 0:
        raise ValueError(f"beta={beta} must be >= 0 (0 disables the KL penalty)")
    if not (math.isfinite(entropy_coef) and entropy_coef >= 0):
        raise ValueError(f"entropy_coef={entropy_coef} must be a finite number >= 0 (0 disables the entropy "
                         "bonus; 1e-3 is a usual start)")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip={dual_clip} must be greater than 1 (typically 3), or null for none")
    if delta is not None and delta <= 1:
        raise ValueError(f"delta={delta} must be greater than 1 (e.g. 4, INTELLECT-2's), or null for none")
    if loss_type != "clip":
        for name, value, off in (("dual_clip", dual_clip, None), ("delta", delta, None),
                                 ("importance_sampling_level", importance_sampling_level, "token")):
            if value != off:
                raise ValueError(f"{name}={value!r} with loss_type={loss_type}: it shapes the PPO clip, which "
                                 f"{loss_type} replaces (it acts on token ratios); set {name}: {off or 'null'} "
                                 "or loss_type: clip")
    if not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError(f"sapo_temperature_pos={sapo_temperature_pos}, sapo_temperature_neg={sapo_temperature_neg} "
                         "must be positive (SAPO uses 1.0 and 1.05)")
