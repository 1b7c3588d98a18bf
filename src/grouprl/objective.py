"""The trainer's glue to the algorithm variants of ``grouprl.core``: the config's plain values in,
one call per place in the loop.

- ``step_advantages``: advantages [N] of a scored batch, from the summed reward (the estimator),
  per token [N, T] from step rewards (process supervision), or,
  with ``multi_objective_aggregation: normalize_then_sum`` (GDPO), from each reward function's scores;
- ``corrects_sampler`` / ``sampler_weights``: whether and how the sampler/trainer mismatch is
  corrected (core/importance.py), with the `is/` metrics;
- ``loss_token_weights``: a micro-batch's token weights for ``policy_loss``: the sampler/trainer
  importance weights, the top-entropy token mask and the off-policy sequence mask, multiplied,
  with the fraction of real tokens each mask dropped.
"""

from __future__ import annotations

import torch

from grouprl.batch import StepBatch
from grouprl.config import TrainConfig
from grouprl.core import compute_advantages, importance_weights, normalize_then_sum, off_policy_sequence_mask, top_entropy_mask
from grouprl.rollout import Rollout


def step_advantages(cfg: TrainConfig, batch: StepBatch) -> torch.Tensor:
    """Advantages of the (global) batch: [N], or [N, T] (one per token) under process supervision,
    where `batch.steps` holds the step rewards (rewards/process.py)."""
    G = cfg.num_generations
    if batch.steps is not None:
        return batch.steps.advantages(G, batch.rollout.completion_ids.shape[1], scale=cfg.scale_rewards,
                                      eps=cfg.advantage_eps)  # [N, T]
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        per_func = torch.stack(list(batch.per_func.values()), dim=-1)  # [N, K], NaN where a function abstained
        return normalize_then_sum(per_func, cfg.reward_weights, G, scale=cfg.scale_rewards, eps=cfg.advantage_eps)
    return compute_advantages(cfg.advantage_estimator, batch.rewards, G, scale=cfg.scale_rewards,
                              eps=cfg.advantage_eps)  # [N]


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


def loss_token_weights(cfg: TrainConfig, rollout: Rollout, rows: torch.Tensor, logp: torch.Tensor,
                       entropy: torch.Tensor | None, mask: torch.Tensor, advantages: torch.Tensor,
                       old_logp: torch.Tensor | None, is_weights: torch.Tensor | None
                       ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Token weights [n, T'] for the micro-batch ``rows`` (None when nothing re-weights), and stats.
    logp, entropy, mask  # [n, T'] on the model's device; advantages  # [n] (or [n, T]); old_logp, is_weights,
    rollout.sampling_logp  # [N, T] for the whole batch (CPU)."""
    T, dev = logp.shape[1], logp.device
    weights = is_weights[rows, :T].to(dev) if is_weights is not None else None  # [n, T']
    stats: dict[str, float] = {}
    n_real = max(int(mask.sum()), 1)
    if cfg.top_entropy_quantile < 1:
        keep = top_entropy_mask(entropy, mask, cfg.top_entropy_quantile)  # [n, T'] from this micro-batch's pass
        stats["entropy_mask/dropped_frac"] = 1 - int(keep.sum()) / n_real
        weights = keep.to(logp.dtype) if weights is None else weights * keep
    if cfg.off_policy_mask_threshold is not None:
        sampler = rollout.sampling_logp if rollout.sampling_logp is not None else old_logp  # [N, T]
        keep_seq = torch.ones(len(rows), dtype=torch.bool, device=dev)  # [n]; on-policy: nothing to drop
        if sampler is not None:
            adv = advantages[:, :T] if advantages.dim() == 2 else advantages  # [n] or per token [n, T']
            keep_seq = off_policy_sequence_mask(logp, sampler[rows, :T].to(dev), adv, mask,
                                                cfg.off_policy_mask_threshold)  # [n]
        stats["off_policy_mask/dropped_frac"] = int((mask & ~keep_seq[:, None]).sum()) / n_real
        keep = keep_seq[:, None].to(logp.dtype).expand_as(logp)  # [n, T']
        weights = keep if weights is None else weights * keep
    return weights, stats
