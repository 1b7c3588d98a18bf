"""On-policy distillation: a frozen teacher's per-token signal on the student's own samples, used as
a per-token advantage, alone or beside the verifier rewards' advantages.

The student π_S samples completion y_i; the teacher π_T scores the same tokens. The signal of token t
(``DISTILL_SIGNALS["reverse_kl"]``) is the negated per-token reverse KL on the sampled token:

    d_{i,t} = log π_T(y_{i,t} | x_i, y_{i,<t}) − log π_old(y_{i,t} | x_i, y_{i,<t})

and the advantage the policy loss receives (``distill_advantages``) is

    A_{i,t} = c_R · A^R_{i(,t)} + λ · d_{i,t}        on the completion's own tokens, 0 elsewhere

with A^R the verifier rewards' advantages from the configured estimator ([N] broadcast over the
tokens, or [N, T] from a per-token estimator), c_R = ``reward_coef`` (config ``distill_reward_coef``)
and λ = ``coef`` (config ``distill_coef``). Distillation alone is c_R = 0, λ = 1 (the
``on_policy_distill`` preset); mixed is c_R = 1 and λ > 0, so A^R keeps its scale (group-normalised,
O(1)) and d adds λ nats per token. d_{i,t} is in nats, not normalised: it is ≤ 0 on average
(E_{y~π_S}[d] = −KL(π_S‖π_T) per token) and exactly 0 where the teacher agrees.

Sources: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, ICLR 2024), the on-policy data with a reverse-KL divergence; Lu & Thinking Machines
Lab, "On-Policy Distillation" (2025) and tinker-cookbook's ``incorporate_kl_penalty``: the sampled
token's log π_T − log π_S added to the advantage with coefficient 1 and discount 0; SkyRL does the same.

Why this signal among the peers' (docs/algorithms.md §1.7 says it at more length):
- the sampled-token advantage with discount 0 (tinker-cookbook, SkyRL) reuses everything the policy
  loss already has: the per-token advantage path of process supervision, the clip, the aggregation
  over the whole batch, the sampler/trainer importance correction. With one update per rollout its
  gradient is λ·d_{i,t}·∇log π_θ(y_{i,t}), the score-function estimate of −∇ of the per-token
  reverse KL; discount 0 drops the later tokens' KL from token t's return, which lowers the
  variance at the price of a bias (the Thinking Machines post trains with it);
- prime-rl's additional weighting by the trainer/inference ratio and masking of tokens whose
  probability fell sharply is the sampler/trainer correction grouprl already applies to every loss
  (core/importance.py, ``vllm_importance_sampling_*``; token masks, core/token_masks.py): it is not
  repeated here;
- TRL's full-vocabulary reverse KL has lower variance, but needs the teacher's whole distribution
  [n, T', V] inside every micro-batch of the update: a teacher forward per pass and logits the
  memory rule (DESIGN.md) never holds.

It is not the KL penalty with the teacher as the reference: β·k3(π_θ, π_T) in the loss has the
gradient (1 − π_T/π_θ)·∇log π_θ, whose expectation is the gradient of the *forward* KL(π_T‖π_θ)
(mode-covering); the reverse KL needs the score-function (advantage) form.

Deliberate choices:
- π_old is the trainer's own log-prob of the sampled token (one no-grad forward before the update),
  not the sampler's: with vLLM the teacher and the student are then scored by the same kernels, and
  the sampler/trainer mismatch is left to the importance correction. tinker uses the sampler's.
- d is not clipped or normalised (tinker neither); the gradient-norm clip bounds a step. rllm clips
  the advantage to [−5, 5]; a teacher that gives a student token probability e^−20 gives d = −20.
- Positions off ``mask`` (padding, tool output inserted into a multi-turn rollout) get exactly 0,
  whatever the inputs hold there; computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .registry import Registry

DistillSignal = Callable[[Tensor, Tensor, Tensor], Tensor]  # (teacher_logp, student_logp, mask) -> [N, T]
DISTILL_SIGNALS: Registry[DistillSignal] = Registry("distillation signal", "grouprl.core.DISTILL_SIGNALS.register")


def _check(name: str, x: Tensor, shape: torch.Size) -> None:
    if not isinstance(x, Tensor) or x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(getattr(x, 'shape', ()))}, expected {tuple(shape)} "
                         "([N, T] like the mask)")


@DISTILL_SIGNALS.register("reverse_kl")
def reverse_kl_signal(teacher_logp: Tensor, student_logp: Tensor, mask: Tensor) -> Tensor:
    """d = log π_T − log π_S on the sampled tokens  # [N, T], 0 where ``mask`` is False.

    teacher_logp, student_logp  # [N, T] log-probs of the sampled tokens; mask  # [N, T] bool (or 0/1)."""
    valid = mask.bool()
    for name, x in (("teacher_logp", teacher_logp), ("student_logp", student_logp)):
        _check(name, x, valid.shape)
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(valid, teacher_logp.float() - student_logp.float(), zero)  # [N, T]


def distill_advantages(advantages: Tensor, signal: Tensor, mask: Tensor, *, coef: float = 1.0,
                       reward_coef: float = 0.0) -> Tensor:
    """A = reward_coef · advantages + coef · signal on ``mask``, 0 elsewhere  # [N, T] float32.

    advantages  # [N] (one per completion, broadcast over its tokens) or [N, T]; signal, mask  # [N, T]."""
    valid = mask.bool()
    _check("signal", signal, valid.shape)
    if not isinstance(advantages, Tensor) or advantages.shape not in (valid.shape[:1], valid.shape):
        raise ValueError(f"advantages has shape {tuple(getattr(advantages, 'shape', ()))}; expected "
                         f"[N]={tuple(valid.shape[:1])} or [N, T]={tuple(valid.shape)}")
    for name, value in (("coef", coef), ("reward_coef", reward_coef)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0")
    adv = advantages.float()
    adv = adv[:, None] if adv.dim() == 1 else adv  # [N, 1] or [N, T]
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(valid, reward_coef * adv + coef * signal.float(), zero)  # [N, T]


def distill_stats(teacher_logp: Tensor, student_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Means over the real tokens: ``reverse_kl`` (log π_S − log π_T, the k1 estimate of the per-token
    KL(π_S‖π_T) on the student's samples), ``teacher_logp`` and ``student_logp``."""
    valid = mask.bool()
    n = max(int(valid.sum()), 1)
    t = float(torch.where(valid, teacher_logp.double(), 0.0).sum()) / n
    s = float(torch.where(valid, student_logp.double(), 0.0).sum()) / n
    return {"reverse_kl": s - t, "teacher_logp": t, "student_logp": s}
