"""The trainer's glue to the algorithm variants of ``grouprl.core``: the config's plain values in,
one call per place in the loop. Each variant is looked up in a core registry under the name the
config gives it (core/registry.py); nothing here branches on a variant.

- ``step_advantages``: advantages of a scored batch: the advantage estimator (``advantage_estimator``;
  "process" reads the step rewards, "gae" a value head's estimates, and each gives one advantage per
  token [N, T]) meets the reward functions as ``multi_objective_aggregation`` says
  ("normalize_then_sum", GDPO, reads each function's scores);
- ``value_targets``: PPO's value-loss targets, V_old and GAE's returns (core/gae.py, value.py);
- ``policy_loss_params``: every loss knob of the config in one ``LossParams``, built once;
- ``loss_mask``: the tokens the loss counts;
- ``corrects_sampler`` / ``sampler_weights``: whether and how the sampler/trainer mismatch is
  corrected (core/importance.py), with the `is/` metrics;
- ``loss_token_weights``: a micro-batch's token weights for ``policy_loss``: the sampler/trainer
  importance weights times every token mask the config switches on (``enabled_token_masks``), with
  the fraction of real tokens each mask dropped.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grouprl.batch import StepBatch
from grouprl.config import TrainConfig
from grouprl.core import (ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS, TOKEN_MASKS, AdvantageInputs,
                          LossParams, MaskInputs, gae_advantages, importance_weights, outcome_token_rewards)
from grouprl.micro_batches import UpdatePart
from grouprl.rollout import Rollout
from grouprl.value import ValueTargets


def advantage_inputs(cfg: TrainConfig, batch: StepBatch, values: torch.Tensor | None = None) -> AdvantageInputs:
    """The scored batch as core's plain values; the step lists (with the outcome as a final step) and
    the padded length T only where rewards/process.py made steps (advantage_estimator: process);
    a value head's estimates `values  # [N, T]` with the action tokens and GAE's γ, λ (gae)."""
    per_func = torch.stack(list(batch.per_func.values()), dim=-1) if batch.per_func else None  # [N, K]; NaN: None
    inputs = AdvantageInputs(batch.rewards, cfg.num_generations, per_func, cfg.reward_weights)  # rewards [N]
    if values is not None:
        inputs = replace(inputs, values=values, token_mask=batch.rollout.action_mask, gamma=cfg.gamma, lam=cfg.lam)
    if batch.steps is None:
        return inputs
    step_rewards, step_ends = batch.steps.with_outcome()  # [N][K_i] each
    return replace(inputs, step_rewards=step_rewards, step_ends=step_ends,
                   num_tokens=batch.rollout.completion_ids.shape[1])


def step_advantages(cfg: TrainConfig, batch: StepBatch, values: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages of the (global) batch: [N], or [N, T] (one per token) from a per-token estimator
    such as process supervision or GAE (which reads the value head's `values  # [N, T]`)."""
    aggregate = MULTI_OBJECTIVE_AGGREGATIONS.get(cfg.multi_objective_aggregation, "multi_objective_aggregation")
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator, "advantage_estimator")
    return aggregate(advantage_inputs(cfg, batch, values), estimator, scale=cfg.scale_rewards, eps=cfg.advantage_eps)


def value_targets(cfg: TrainConfig, rewards: torch.Tensor, action_mask: torch.Tensor,
                  values: torch.Tensor | None) -> ValueTargets | None:
    """V_old and GAE's returns R = A + V_old (A before any whitening) for the value loss, from the
    outcome rewards [N], the action tokens [N, T] and the head's estimates [N, T]; None without them."""
    if values is None:
        return None
    token_rewards = outcome_token_rewards(rewards, action_mask)  # [N, T]
    _, returns = gae_advantages(token_rewards, values, action_mask, gamma=cfg.gamma, lam=cfg.lam)  # [N, T]
    return ValueTargets(values, returns)


def policy_loss_params(cfg: TrainConfig) -> LossParams:
    """The loss knobs of a validated config as one ``LossParams`` (validated on construction), built once
    and passed to every ``policy_loss`` call."""
    return LossParams(eps_low=cfg.epsilon, eps_high=cfg.epsilon_high, ratio_level=cfg.importance_sampling_level,
                      agg=cfg.loss_agg, max_tokens=cfg.max_completion_length, beta=cfg.beta,
                      kl_kind=cfg.kl_estimator, dual_clip=cfg.dual_clip, delta=cfg.delta, loss_type=cfg.loss_type,
                      sapo_tau_pos=cfg.sapo_temperature_pos, sapo_tau_neg=cfg.sapo_temperature_neg,
                      entropy_coef=cfg.entropy_coef)


def loss_mask(cfg: TrainConfig, rollout: Rollout) -> torch.Tensor:
    """The tokens the loss counts [N, T]: the policy's own (not the context a multi-turn rollout
    inserted), and none of a truncated completion's with mask_truncated_completions."""
    mask = rollout.action_mask.clone()  # [N, T]
    if cfg.mask_truncated_completions:
        mask &= ~rollout.truncated[:, None]
    return mask


def corrects_sampler(cfg: TrainConfig, rollout: Rollout) -> bool:
    """Whether the sampler/trainer mismatch is corrected: by default whenever the engine returned
    the log-probs it sampled with (Rollout.sampling_logp; config validation requires use_vllm when
    the correction is forced on)."""
    return rollout.sampling_logp is not None and cfg.vllm_importance_sampling_correction is not False


def sampler_weights(cfg: TrainConfig, rollout: Rollout, old_logp: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Sampler/trainer importance-sampling weights [N, T] for the policy loss from the trainer's
    old log-probs of the whole batch [N, T], and the batch's mismatch metrics under `is/`."""
    weights, stats = importance_weights(
        old_logp, rollout.sampling_logp, rollout.action_mask, cfg.vllm_importance_sampling_mode,
        cap=cfg.vllm_importance_sampling_cap, cap_min=cfg.vllm_importance_sampling_min)  # [N, T]
    return weights, {f"is/{k}": v for k, v in stats.items()}


def enabled_token_masks(cfg: TrainConfig) -> dict[str, float]:
    """The token masks (core ``TOKEN_MASKS``) the config switches on, name -> the mask's parameter:
    "entropy_mask" when top_entropy_quantile < 1, "off_policy_mask" when off_policy_mask_threshold is set."""
    settings = {"entropy_mask": cfg.top_entropy_quantile if cfg.top_entropy_quantile < 1 else None,
                "off_policy_mask": cfg.off_policy_mask_threshold}
    return {name: value for name, value in settings.items() if value is not None}


def loss_token_weights(cfg: TrainConfig, logp: torch.Tensor, entropy: torch.Tensor | None,
                       part: UpdatePart) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Token weights [n, T'] for one pass's `part` of the update batch (None when nothing re-weights),
    and stats (``<mask>/dropped_frac``: the fraction of real tokens each enabled token mask dropped).
    logp, entropy  # [n, T'] on the model's device, from this pass."""
    weights = part.is_weights  # [n, T']
    masks = enabled_token_masks(cfg)
    if not masks:
        return weights, {}
    mask = part.loss_mask  # [n, T']
    inputs = MaskInputs(logp, mask, part.advantages, entropy, part.sampler_logp())  # sampler None: on-policy
    stats: dict[str, float] = {}
    n_real = max(int(mask.sum()), 1)
    for name, value in masks.items():
        keep = TOKEN_MASKS.get(name)(inputs, value)  # [n, T'] bool
        stats[f"{name}/dropped_frac"] = int((mask & ~keep).sum()) / n_real
        weights = keep.to(logp.dtype) if weights is None else weights * keep
    return weights, stats
