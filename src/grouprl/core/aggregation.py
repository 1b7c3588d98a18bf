"""Loss aggregation: one reducer, ``aggregate_loss``, from per-token losses to the scalar that is
differentiated, with named modes (``LOSS_AGGREGATIONS``). D is the divisor, m the mask of real tokens:

    "token-mean"              Σ_{i,t} m·ℓ / D,   D = Σ_{i,t} m          DAPO
    "seq-mean-token-mean"     Σ_i (Σ_t m·ℓ / Σ_t m) / D,   D = N        GRPO paper
    "seq-mean-token-sum"      Σ_{i,t} m·ℓ / D,   D = N
    "seq-mean-token-sum-norm" Σ_{i,t} m·ℓ / (D·L_max),   D = N          Dr. GRPO (L_max = max_tokens)

The whole-batch normaliser: ``normalizer`` replaces D by the count over the whole optimizer batch
(tokens for token-mean, completions otherwise), so micro-batches and data-parallel ranks sum to the
full-batch loss and gradient exactly. A sequence with no real tokens contributes 0 to its seq-mean
(0/1) but still counts in N. Formulas and sources: docs/algorithms.md.

Choice: padding is removed with ``torch.where`` before the reducer runs, so garbage (even inf/nan)
in padded positions changes nothing and gets zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .registry import Registry

AggFn = Callable[..., Tensor]  # fn(loss [N, T] zero on padding, mask [N, T] bool, *, max_tokens, normalizer)
LOSS_AGGREGATIONS: Registry[AggFn] = Registry("loss aggregation", "grouprl.core.register_loss_agg")


_DIVIDES_BY_TOKENS: set[str] = set()  # aggregations whose divisor D counts tokens, not completions


def register_loss_agg(name: str, *, divides_by: str = "completions") -> Callable[[AggFn], AggFn]:
    """Decorator: register ``fn(loss, mask, *, max_tokens, normalizer) -> scalar`` (loss zero on padding).
    ``divides_by`` says what the divisor D counts, "completions" or "tokens": the trainer counts the
    same over the whole optimizer batch (``batch_normalizer``) and passes it as ``normalizer``."""
    if divides_by not in ("completions", "tokens"):
        raise ValueError(f"divides_by={divides_by!r}: an aggregation divides by 'completions' or 'tokens'")

    def decorator(fn: AggFn) -> AggFn:
        LOSS_AGGREGATIONS.register(name)(fn)
        if divides_by == "tokens":
            _DIVIDES_BY_TOKENS.add(name)
        else:
            _DIVIDES_BY_TOKENS.discard(name)
        return fn

    return decorator


def batch_normalizer(mode: str, mask: Tensor) -> int:
    """D of aggregation ``mode`` over a whole optimizer batch (``mask  # [N, T]``, the real tokens of
    every micro-batch and rank): its real tokens, or its N completions. A batch with no real token
    (every completion masked, e.g. all truncated under mask_truncated_completions) counts 1, as the
    one-pass ``token-mean`` does: its loss and gradient are then 0, not an error."""
    LOSS_AGGREGATIONS.get(mode, "agg")
    return max(int(mask.sum()), 1) if mode in _DIVIDES_BY_TOKENS else mask.shape[0]


@register_loss_agg("token-mean", divides_by="tokens")
def _token_mean(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    count = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return loss.sum() / count


@register_loss_agg("seq-mean-token-mean")
def _seq_mean_token_mean(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    seq_mean = loss.sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return seq_mean.sum() / (loss.shape[0] if normalizer is None else normalizer)


@register_loss_agg("seq-mean-token-sum")
def _seq_mean_token_sum(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    return loss.sum() / (loss.shape[0] if normalizer is None else normalizer)


@register_loss_agg("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, *, max_tokens=None, normalizer=None) -> Tensor:
    if max_tokens is None:
        raise ValueError("agg='seq-mean-token-sum-norm' needs max_tokens (L_max, the maximum number "
                         "of completion tokens, e.g. max_completion_length)")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    n_seq = loss.shape[0] if normalizer is None else normalizer
    return loss.sum() / (n_seq * max_tokens)


def bool_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    """``mask`` (bool or 0/1 float, nonzero = real token) as bool, once its shape is checked to be ``shape``."""
    if not isinstance(mask, Tensor) or mask.shape != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask has shape {got}, expected {tuple(shape)} (one entry per completion token)")
    return mask if mask.dtype == torch.bool else mask != 0


def aggregate_loss(per_token_loss: Tensor, mask: Tensor, mode: str, *, max_tokens: int | None = None,
                   normalizer: float | Tensor | None = None) -> Tensor:
    """Reduce ``per_token_loss  # [N, T]`` over real tokens (``mask  # [N, T]``) with ``mode``."""
    agg_fn = LOSS_AGGREGATIONS.get(mode, "agg")
    if per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss has shape {tuple(per_token_loss.shape)}; expected [N, T]")
    valid = bool_mask(mask, per_token_loss.shape)  # [N, T]
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"normalizer={normalizer} must be positive (the optimizer batch's count)")
    loss = torch.where(valid, per_token_loss, torch.zeros_like(per_token_loss))  # [N, T]
    return agg_fn(loss, valid, max_tokens=max_tokens, normalizer=normalizer)
