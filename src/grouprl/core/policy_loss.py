"""The clipped policy loss of the GRPO family: ``policy_loss``, one call per micro-batch, with every
knob in a ``LossParams`` built (and validated) once. Formulas and sources: docs/algorithms.md.

Per token, with ρ the importance ratio and ℓ the policy term (``LOSS_TYPES``, policy_terms.py:
"clip", the PPO/GRPO clipped surrogate, by default):

    ℓ_{i,t} = POLICY_TERM(ρ, A)                      e.g. max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))
    KL penalty (DeepSeekMath):                       ℓ += β·KL_{i,t}   (see kl.py)
    token weights (importance.py, sampler/trainer IS correction; token_masks.py): the policy term,
    before the KL penalty is added, is multiplied by sg[weight_{i,t}]; TRL and verl leave the KL
    term unweighted too
    loss = aggregate_loss(ℓ, mask, agg)              (aggregation.py: the modes and the normaliser)

Ratio levels (``RATIO_LEVELS``):
    "token"    ρ_{i,t} = exp(logp − old)
    "sequence" GSPO (arXiv 2507.18071): s_i = exp((1/|o_i|)·Σ_t m·(logp − old)), in the GSPO-token
               form s_{i,t} = sg[s_i]·exp(logp_t − sg[logp_t]) whose value is s_i and whose gradient
               is s_i·∂logp_t; with seq-mean-token-mean this is GSPO's sequence gradient.

Choices: padding is removed with ``torch.where`` before any arithmetic, so garbage (even inf/nan)
in padded logp/old/ref/advantages changes nothing and gets zero gradient. ``old_logp`` and the
advantages are treated as constants (detached). ``approx_kl`` is cleanRL's (ρ − 1) − log ρ,
the k3 estimate of KL(π_old ‖ π_θ) on the sampled tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import LOSS_AGGREGATIONS, _bool_mask, aggregate_loss
from .kl import KL_ESTIMATORS, kl_estimate
from .policy_terms import LOSS_TYPES
from .registry import Registry

RatioFn = Callable[[Tensor, Tensor, Tensor], Tensor]
RATIO_LEVELS: Registry[RatioFn] = Registry("ratio level", "grouprl.core.register_ratio_level")


def register_ratio_level(name: str) -> Callable[[RatioFn], RatioFn]:
    """Decorator: register ``fn(logp, old_logp, mask) -> ratio [N, T]`` (inputs already zero on padding)."""
    return RATIO_LEVELS.register(name)


@register_ratio_level("token")
def _token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return torch.exp(logp - old_logp)  # [N, T]


@register_ratio_level("sequence")
def _sequence_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    seq_logratio = (logp - old_logp).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    s = torch.exp(seq_logratio).detach()  # [N] sg[s_i]
    return s[:, None] * torch.exp(logp - logp.detach())  # [N, T] value s_i, gradient s_i·∂logp


@dataclass(frozen=True)
class LossParams:
    """Every knob of ``policy_loss``, as plain values, validated once at construction.

    eps_low/eps_high bound the clip (and cispo's IS weight); eps_high=None means eps_low.
    ratio_level (``RATIO_LEVELS``), agg (``LOSS_AGGREGATIONS``; max_tokens is L_max for
    seq-mean-token-sum-norm), beta and kl_kind (``KL_ESTIMATORS``) the KL penalty, dual_clip and delta
    the clip's caps, loss_type the policy term (``LOSS_TYPES``), sapo_tau_pos/neg SAPO's temperatures.
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

    def __post_init__(self) -> None:
        RATIO_LEVELS.get(self.ratio_level, "ratio_level")
        LOSS_TYPES.get(self.loss_type, "loss_type")
        LOSS_AGGREGATIONS.get(self.agg, "agg")
        KL_ESTIMATORS.get(self.kl_kind, "kl_kind")
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", self.eps_low)
        check_loss_settings(epsilon=self.eps_low, epsilon_high=self.eps_high, beta=self.beta, dual_clip=self.dual_clip,
                            delta=self.delta, loss_type=self.loss_type, importance_sampling_level=self.ratio_level,
                            sapo_temperature_pos=self.sapo_tau_pos, sapo_temperature_neg=self.sapo_tau_neg)


def check_loss_settings(*, epsilon: float, epsilon_high: float, beta: float, dual_clip: float | None,
                        delta: float | None, loss_type: str, importance_sampling_level: str,
                        sapo_temperature_pos: float, sapo_temperature_neg: float) -> None:
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


def _check_inputs(logp, old_logp, advantages, mask, ref_logp, token_weights) -> None:
    if not isinstance(logp, Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [N, T] tensor, got {getattr(logp, 'shape', type(logp))}")
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_weights", token_weights)):
        if x is not None and (not isinstance(x, Tensor) or x.shape != logp.shape):
            raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}, expected "
                             f"{tuple(logp.shape)} like logp")
    if not isinstance(advantages, Tensor) or advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages has shape {tuple(getattr(advantages, 'shape', ()))}; expected "
                         f"[N]={tuple(logp.shape[:1])} (one per completion) or [N, T]={tuple(logp.shape)}")



def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, params: LossParams | None = None,
                *, ref_logp: Tensor | None = None, normalizer: float | Tensor | None = None,
                token_weights: Tensor | None = None, **knobs) -> tuple[Tensor, dict[str, float]]:
    """Policy loss (scalar) and detached stats; see the module docstring.

    logp, old_logp, ref_logp, mask, token_weights  # [N, T];  advantages  # [N] or [N, T]
    mask is bool or 0/1 float (nonzero = real completion token). ``params`` holds every knob (built
    once, e.g. by the trainer); without it the knobs may be given as keywords, ``LossParams``' fields
    (``policy_loss(..., eps_low=0.2, agg="token-mean")``), validated on this call.
    token_weights (detached) multiply each token's policy term; they leave the normaliser alone.
    normalizer replaces the aggregation's divisor by the whole optimizer batch's count (aggregation.py).
    Stats (Python floats, means over this call's real tokens): clip_frac_low (ρ < 1−ε_low, A < 0),
    clip_frac_high (ρ > 1+ε_high, A > 0), clip_frac, ratio_mean, approx_kl, num_tokens; kl (the
    ``kl_kind`` estimate to ref) whenever ref_logp is given; the policy term's flags (dual_clip_frac
    when dual_clip is set with "clip", is_clip_frac with "cispo").
    """
    _check_inputs(logp, old_logp, advantages, mask, ref_logp, token_weights)
    valid = _bool_mask(mask, logp.shape)  # [N, T]
    if params is None:
        params = LossParams(**knobs)
    elif knobs:
        raise TypeError(f"policy_loss got params and the keywords {sorted(knobs)}: put them in LossParams")
    if params.beta > 0 and ref_logp is None:
        raise ValueError(f"beta={params.beta} > 0 needs ref_logp (reference-model log-probs); pass "
                         "ref_logp or set beta=0")

    # Padding goes first: nothing downstream may see garbage, not even through 0·inf.
    zero = logp.new_zeros(())
    logp = torch.where(valid, logp, zero)  # [N, T]
    old_logp = torch.where(valid, old_logp.detach(), zero)  # [N, T]
    adv = advantages.detach()
    adv = torch.where(valid, adv[:, None] if adv.dim() == 1 else adv, zero)  # [N, T]

    ratio = RATIO_LEVELS[params.ratio_level](logp, old_logp, valid)  # [N, T]
    per_token, flags = LOSS_TYPES[params.loss_type](logp, ratio, adv, params)  # [N, T]
    if token_weights is not None:
        per_token = per_token * torch.where(valid, token_weights.detach(), zero)  # [N, T]
    kl = None
    if ref_logp is not None:
        kl = kl_estimate(logp, torch.where(valid, ref_logp.detach(), zero), params.kl_kind)  # [N, T]
        if params.beta > 0:
            per_token = per_token + params.beta * kl
    loss = aggregate_loss(per_token, valid, params.agg, max_tokens=params.max_tokens, normalizer=normalizer)

    with torch.no_grad():
        num_tokens = valid.sum()
        denom = num_tokens.clamp(min=1).double()  # fp64 stats: fractions of counts stay exact

        def masked_mean(x: Tensor) -> Tensor:
            return torch.where(valid, x, zero).sum() / denom

        low = (ratio < 1 - params.eps_low) & (adv < 0) & valid
        high = (ratio > 1 + params.eps_high) & (adv > 0) & valid
        values = {
            "clip_frac_low": low.sum() / denom,
            "clip_frac_high": high.sum() / denom,
            "clip_frac": (low | high).sum() / denom,
            "ratio_mean": masked_mean(ratio),
            "approx_kl": masked_mean(kl_estimate(old_logp, logp, "k3")),
            "num_tokens": num_tokens,
        }
        if kl is not None:
            values["kl"] = masked_mean(kl)
        for name, flag in flags.items():
            values[name] = (flag & valid).sum() / denom
        floats = torch.stack([v.double() for v in values.values()]).tolist()  # one device sync
    return loss, dict(zip(values, floats))
