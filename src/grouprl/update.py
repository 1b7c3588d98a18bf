"""The machinery under the trainer's `update` stage: micro-batch plans, the no-grad log-prob passes,
and one optimizer step accumulated over micro-batches (and ranks).

`Trainer.update` reads as the stage (old/ref log-probs, then num_iterations optimizer steps); this
module is what each of those calls does. It holds the model and the pass settings fixed at start
(precision, packing, prompt sharing), nothing else: the optimizer, the scheduler, the config and
the loss parameters stay the trainer's and are passed in, so a script that swaps one of them on
the trainer (a test's SGD at lr 0, a new config) changes what the next step uses.

Deliberate choices:
- micro-batches are formed from completions sorted by length, so little padding is computed; with
  prompt sharing a group's completions stay together, so its prompt runs once;
- each optimizer step covers the whole batch: the loss normaliser counts the whole (global) batch
  (`core.batch_normalizer`), so the accumulated gradient equals the full-batch gradient for every
  aggregation mode; DDP/FSDP2 average gradients over the K ranks, so each rank's loss is scaled by K;
- a non-finite loss or gradient norm skips the step: weights and optimizer state stay as they were.
  The scheduler still steps: the learning rate follows the step count (max_steps * num_iterations
  slots), so a skipped step spends its slot and the schedule, the logged `lr` and a resume stay
  aligned with the steps.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from grouprl import distributed as D
from grouprl.config import TrainConfig
from grouprl.core import batch_normalizer, policy_loss
from grouprl.memory import CPU_BUDGET
from grouprl.objective import loss_token_weights
from grouprl.policy import MicroBatch, activation_checkpointing, completion_logprobs, plan_micro_batches
from grouprl.rollout import Rollout
from grouprl.update_stats import UpdateSums

logger = logging.getLogger(__name__)


class PolicyUpdate:
    """Passes over a rollout with the policy (or the reference), and optimizer steps on it.

    `model` is the plain module, `train_model` the one the update runs (the DDP wrapper; FSDP2
    shards in place, so the same module); `autocast` the matmul dtype (None: fp32); `packed`: the
    passes run padding-free; `share_min_tokens`: a group's prompt is stored once when that saves at
    least this many tokens (None: never; padded passes only); `auto_budget`: the token budget that
    `max_tokens_per_micro_batch: auto` means on this device, and `checkpoint_over_budget`: whether a
    pass over the budget checkpoints its activations (`gradient_checkpointing: auto` on CPU; on CUDA
    the model checkpoints every pass): memory.py."""

    def __init__(self, model: torch.nn.Module, train_model: torch.nn.Module, dist: D.DistContext, *,
                 autocast: torch.dtype | None, packed: bool, share_min_tokens: int | None,
                 auto_budget: int | None = None, checkpoint_over_budget: bool = True):
        self.model, self.train_model = model, train_model
        self.dist, self.autocast, self.packed, self.share_min_tokens = dist, autocast, packed, share_min_tokens
        self.auto_budget, self.checkpoint_over_budget = auto_budget, checkpoint_over_budget
        self._warned_over_budget = False  # a sequence above max_tokens_per_micro_batch was logged

    def budget(self, cfg: TrainConfig) -> int | None:
        """Tokens per pass: the config's number, or what `auto` means on this device."""
        budget = cfg.max_tokens_per_micro_batch
        if budget == "auto":
            return self.auto_budget or CPU_BUDGET
        return budget  # type: ignore[return-value]

    def micro_batches(self, rollout: Rollout, cfg: TrainConfig) -> list[tuple[torch.Tensor, float]]:
        """This rank's micro-batches as (rows, loss weight); weight 0 marks a padding pass."""
        order = torch.argsort(rollout.lengths, stable=True)  # similar lengths share a micro-batch
        if self.share_min_tokens is not None:  # ... and a group's completions stay together: its prompt runs once
            group = rollout.prompt_groups()[order]
            order = order[torch.argsort(group, stable=True)]
        budget = self.budget(cfg)
        batches, over = plan_micro_batches(rollout, order, cfg.micro_batch_size, budget, packed=self.packed)
        if over and self.dist.is_main and not self._warned_over_budget:
            self._warned_over_budget = True  # once per run
            logger.warning("%d sequence(s) longer than max_tokens_per_micro_batch=%d ran alone in their pass: "
                           "raise the budget if memory allows", over, budget)
        return D.micro_batch_plan(self.dist, batches)

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, rollout: Rollout, cfg: TrainConfig) -> torch.Tensor:
        """Log-probs [N, T] of this rank's rows under `model` (the rows of its micro-batches; others stay 0)."""
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)  # [N, T]
        with D.full_weights(model):
            for rows, weight in self.micro_batches(rollout, cfg):
                if weight == 0:
                    continue
                mb = MicroBatch.from_rollout(rollout, rows, self.share_min_tokens)
                logp, _ = completion_logprobs(model, mb, temperature=cfg.temperature, autocast_dtype=self.autocast,
                                              packed=self.packed)
                out[rows, : logp.shape[1]] = logp.float().cpu()
        return out

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scheduler: Any, cfg: TrainConfig, loss_params: Any,
                       step: int, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor,
                       old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None, is_weights: torch.Tensor | None,
                       with_entropy: bool) -> dict[str, float]:
        """One optimizer step over the whole batch, accumulated over micro-batches (and ranks); its
        statistics, with `skipped_nonfinite` 1 when a non-finite loss or gradient norm skipped it.
        `step` names the training step in the log line."""
        K = self.dist.world_size
        normalizer = batch_normalizer(cfg.loss_agg, loss_mask)  # D over the whole (global) batch
        optimizer.zero_grad(set_to_none=True)
        sums = UpdateSums()
        plan, budget = self.micro_batches(rollout, cfg), self.budget(cfg)
        for i, (rows, weight) in enumerate(plan):
            mb = MicroBatch.from_rollout(rollout, rows, self.share_min_tokens)
            over_budget = budget is not None and mb.num_tokens(self.packed) > budget  # a lone long sequence
            with D.grad_sync(self.train_model, i == len(plan) - 1), \
                    activation_checkpointing(self.model, over_budget and self.checkpoint_over_budget
                                             and cfg.gradient_checkpointing == "auto"):
                logp, entropy = completion_logprobs(self.train_model, mb, temperature=cfg.temperature,
                                                    autocast_dtype=self.autocast, with_entropy=with_entropy,
                                                    packed=self.packed)
                T, dev = logp.shape[1], logp.device

                def part(x: torch.Tensor | None) -> torch.Tensor | None:  # this micro-batch's rows, [n, T']
                    return None if x is None else x[rows, :T].to(dev)

                mask = part(loss_mask)  # [n, T']
                adv = advantages[rows].to(dev) if advantages.dim() == 1 else part(advantages)  # [n] or [n, T']
                weights, mask_stats = loss_token_weights(cfg, rollout, rows, logp, entropy, mask, adv, old_logp,
                                                         is_weights)
                loss, stats = policy_loss(logp, logp.detach() if old_logp is None else part(old_logp), adv, mask,
                                          params=loss_params, ref_logp=part(ref_logp), normalizer=normalizer,
                                          token_weights=weights)
                (loss * (weight * K)).backward()
            acts = None if entropy is None else rollout.action_mask[rows, :T].to(entropy.device)  # [n, T']
            sums.add(weight, loss.item(), {**stats, **mask_stats},
                     None if entropy is None else float(entropy[acts].sum()))
        params = [p for p in self.model.parameters() if p.requires_grad]
        # both are global, so every rank decides alike: the norm is taken over gradients DDP already
        # summed (FSDP2: reduced over the shards), the loss is summed over ranks
        grad_norm = D.local_value(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf))
        reduced = D.all_reduce_sums(self.dist, sums.sums)
        nonfinite = [name for name, v in (("loss", reduced["loss"]), ("grad norm", grad_norm)) if not math.isfinite(v)]
        if nonfinite:  # the NaN/inf gradients go (below); weights and Adam moments stay
            if self.dist.is_main:
                logger.warning("step %d: non-finite %s (loss %s, grad norm %s): optimizer step skipped, weights and "
                               "optimizer state unchanged", step, " and ".join(nonfinite), reduced["loss"], grad_norm)
        else:
            optimizer.step()
        # the gradients are freed now, not at the next step's start: they would otherwise live through
        # the next generation, beside its KV cache (on a GPU: |θ| fp32 bytes at the step's peak)
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # after a skipped first step torch warns that the scheduler led: meant
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
            scheduler.step()
        return {**sums.result(reduced, int(rollout.action_mask.sum()), grad_norm),
                "skipped_nonfinite": int(bool(nonfinite))}
