"""The machinery under the trainer's `update` stage: the no-grad log-prob passes, and one optimizer
step over an `UpdateBatch`, accumulated over micro-batches (and ranks); micro_batches.py plans the
passes.

`Trainer.update` reads as the stage (old/ref log-probs, then num_iterations optimizer steps); this
module is what each of those calls does. It holds the model and the pass settings fixed at start
(precision, the micro-batch planner), nothing else: the optimizer, the scheduler, the config and
the loss parameters stay the trainer's and are passed in, so a script that swaps one of them on
the trainer (a test's SGD at lr 0, a new config) changes what the next step uses.

Deliberate choices:
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
from dataclasses import replace

import torch
from torch.optim.lr_scheduler import LRScheduler

from grouprl import distributed as D
from grouprl.config import TrainConfig
from grouprl.core import LossParams, batch_normalizer, policy_loss
from grouprl.micro_batches import MicroBatchPlanner, UpdateBatch
from grouprl.objective import loss_token_weights
from grouprl.packing import supports_packing
from grouprl.policy import activation_checkpointing, can_share_prompts, completion_forward, completion_logprobs
from grouprl.rollout import Rollout
from grouprl.update_stats import UpdateSums
from grouprl.value import add_value_loss, make_value_head, optimized_modules

logger = logging.getLogger(__name__)


def make_policy_update(cfg: TrainConfig, model: torch.nn.Module, train_model: torch.nn.Module, dist: D.DistContext,
                       *, autocast: torch.dtype | None, auto_budget: int | None,
                       checkpoint_over_budget: bool) -> PolicyUpdate:
    """The update with its passes set up from the config and the model: packed (padding_free) when
    the model's attention can run packed (packing.py), else padded; a group's prompt stored once
    when share_prompt_forward can run (policy.can_share_prompts), or always when packed."""
    packed = cfg.padding_free and supports_packing(model)  # packing.py: no padding computed
    if cfg.padding_free and not packed and dist.is_main:
        logger.info("padding_free: the model's attention (%s) cannot run packed: passes run padded",
                    getattr(model.config, "_attn_implementation", None))
    # padded passes: FSDP2 frees the gathered weights after each forward, which the prompt pass's graph needs
    shared = cfg.share_prompt_forward and can_share_prompts(model) and not D.is_sharded(model)
    share_min_tokens = 0 if packed else cfg.share_prompt_min_tokens if shared else None
    planner = MicroBatchPlanner(dist, packed=packed, share_min_tokens=share_min_tokens, auto_budget=auto_budget)
    return PolicyUpdate(model, train_model, dist, autocast=autocast, planner=planner,
                        checkpoint_over_budget=checkpoint_over_budget, value_head=make_value_head(cfg, model, dist))


class PolicyUpdate:
    """Passes over a rollout with the policy (or the reference), and optimizer steps on it.

    `model` is the plain module, `train_model` the one the update runs (the DDP wrapper; FSDP2
    shards in place, so the same module); `autocast` the matmul dtype (None: fp32); `planner` how
    a batch is cut into passes (micro_batches.py: packed or padded, prompt sharing, the token
    budget); `checkpoint_over_budget`: whether a pass over the budget checkpoints its activations
    (`gradient_checkpointing: auto` on CPU; on CUDA the model checkpoints every pass): memory.py.
    `value_head`: PPO's value head (value.py), trained in the same passes; None without one."""

    def __init__(self, model: torch.nn.Module, train_model: torch.nn.Module, dist: D.DistContext, *,
                 autocast: torch.dtype | None, planner: MicroBatchPlanner, checkpoint_over_budget: bool = True,
                 value_head: torch.nn.Module | None = None):
        self.model, self.train_model, self.dist, self.autocast = model, train_model, dist, autocast
        self.planner, self.checkpoint_over_budget, self.value_head = planner, checkpoint_over_budget, value_head
        self.trainable = optimized_modules(model, value_head)  # what the optimizer steps, as one module

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, rollout: Rollout, cfg: TrainConfig) -> torch.Tensor:
        """Log-probs [N, T] of this rank's rows under `model` (the rows of its micro-batches; others stay 0)."""
        return self._no_grad_passes(model, rollout, cfg, lambda mb: completion_logprobs(
            model, mb, temperature=cfg.temperature, autocast_dtype=self.autocast, packed=self.planner.packed)[0])

    @torch.no_grad()
    def values(self, rollout: Rollout, cfg: TrainConfig) -> torch.Tensor | None:
        """The value head's estimates [N, T] of the rollout under the current policy (PPO's V_old), for
        the whole batch on every rank; None without a value head."""
        if self.value_head is None:
            return None
        out = self._no_grad_passes(self.model, rollout, cfg, lambda mb: completion_forward(
            self.model, mb, temperature=cfg.temperature, autocast_dtype=self.autocast, packed=self.planner.packed,
            value_head=self.value_head, logprobs=False)[2])  # [N, T]
        return D.all_reduce_tensor(self.dist, out)  # each rank filled its own rows: the sum is the whole batch

    def _no_grad_passes(self, model: torch.nn.Module, rollout: Rollout, cfg: TrainConfig, per_token) -> torch.Tensor:
        """`per_token(micro_batch)  # [n, T']` over this rank's micro-batches, into [N, T] on the host
        (other rows stay 0). FSDP2: the weights are gathered once, so that ranks with fewer passes wait
        on no forward."""
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)  # [N, T]
        with D.full_weights(model):
            for rows, weight in self.planner.plan(rollout, cfg):
                if weight == 0:
                    continue
                x = per_token(self.planner.micro_batch(rollout, rows))  # [n, T']
                out[rows, : x.shape[1]] = x.float().cpu()
        return out

    def optimizer_step(self, batch: UpdateBatch, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                       cfg: TrainConfig, loss_params: LossParams, *, with_entropy: bool) -> dict[str, float]:
        """One optimizer step over the whole batch, accumulated over micro-batches (and ranks); its
        statistics, with `skipped_nonfinite` 1 when a non-finite loss or gradient norm skipped it.
        `with_entropy`: report the entropy (and compute it for the token masks); an entropy bonus
        (loss_params.entropy_coef > 0) computes it in every pass anyway, with a gradient."""
        K, rollout, packed = self.dist.world_size, batch.rollout, self.planner.packed
        normalizer = batch_normalizer(cfg.loss_agg, batch.loss_mask)  # D over the whole (global) batch
        optimizer.zero_grad(set_to_none=True)
        sums = UpdateSums()
        plan, budget = self.planner.plan(rollout, cfg), self.planner.budget(cfg)
        bonus = loss_params.entropy_coef > 0  # the entropy enters the loss: every pass computes it, with a gradient
        for i, (rows, weight) in enumerate(plan):
            mb = self.planner.micro_batch(rollout, rows)
            over_budget = budget is not None and mb.num_tokens(packed) > budget  # a lone long sequence
            with D.grad_sync(self.train_model, i == len(plan) - 1), \
                    activation_checkpointing(self.model, over_budget and self.checkpoint_over_budget
                                             and cfg.gradient_checkpointing == "auto"):
                logp, entropy, values = completion_forward(
                    self.train_model, mb, temperature=cfg.temperature, autocast_dtype=self.autocast,
                    with_entropy=with_entropy or bonus, entropy_grad=bonus, packed=packed,
                    value_head=self.value_head)  # [n, T'] each
                part = batch.part(rows, logp.shape[1], logp.device)  # the batch's [n, T'] slices
                if weight == 0:  # a padding pass: its rows are another rank's, whose old/ref log-probs
                    # this rank never computed (0 here); its own log-probs stand in, so that an overflow
                    # (k3's exp(ref - logp)) cannot turn its zero-weight loss into NaN gradients
                    part = replace(part, old_logp=None if part.old_logp is None else logp.detach(),
                                   ref_logp=None if part.ref_logp is None else logp.detach())
                weights, mask_stats = loss_token_weights(cfg, logp, entropy, part)
                loss, stats = policy_loss(logp, logp.detach() if part.old_logp is None else part.old_logp,
                                          part.advantages, part.loss_mask, params=loss_params, ref_logp=part.ref_logp,
                                          normalizer=normalizer, token_weights=weights, entropy=entropy)
                loss, stats = add_value_loss(loss, stats, values, part.old_values, part.returns, part.loss_mask, cfg,
                                             normalizer)  # PPO: + vf_coef * the value loss (value.py)
                (loss * (weight * K)).backward()
            acts = None if entropy is None else part.take(rollout.action_mask)  # [n, T']
            sums.add(weight, loss.item(), {**stats, **mask_stats},
                     None if entropy is None else float(entropy.detach()[acts].sum()))
        if self.value_head is not None:  # outside DDP/FSDP2: averaged here, as they average the model's
            D.average_gradients(self.dist, self.value_head.parameters())
        modules = [m for m in (self.model, self.value_head) if m is not None]
        groups = [[p for p in m.parameters() if p.requires_grad] for m in modules]
        # both are global, so every rank decides alike: the norm is taken over gradients DDP already
        # summed (FSDP2: reduced over the shards), the loss is summed over ranks
        grad_norm = D.clip_grad_norm(groups, cfg.max_grad_norm)
        reduced = D.all_reduce_sums(self.dist, sums.sums)
        nonfinite = [name for name, v in (("loss", reduced["loss"]), ("grad norm", grad_norm)) if not math.isfinite(v)]
        if nonfinite:  # the NaN/inf gradients go (below); weights and Adam moments stay
            if self.dist.is_main:
                logger.warning("step %d: non-finite %s (loss %s, grad norm %s): optimizer step skipped, weights and "
                               "optimizer state unchanged", batch.step, " and ".join(nonfinite), reduced["loss"],
                               grad_norm)
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
