"""The update's input as one object, and how it is cut into micro-batches.

`UpdateBatch` is what every optimizer step of a training step reads, for the whole (global) batch:
the rollout, the advantages, the loss mask, the old and reference log-probs, the sampler/trainer
importance weights, and PPO's value targets. `UpdateBatch.part(rows, ...)` is one pass's share of it
(`UpdatePart`), trimmed to the pass's own completion length and on the model's device.

Planning, in the order the update does it (`MicroBatchPlanner.plan`):
- the rows are sorted by length, so similar lengths share a micro-batch and little padding is
  computed; with prompt sharing a group's completions stay together, so its prompt runs once;
- `plan_micro_batches` cuts that order into micro-batches of at most `micro_batch_size` rows and
  `max_tokens_per_micro_batch` tokens as a pass computes them (padded, or packed: `packed_tokens`);
- under torchrun rank r runs micro-batches r, r+K, ... (`rank_share`), padded with weight-0
  repeats so every rank runs as many passes (grouprl/distributed.py says why);
- each pass's rows become a `MicroBatch`, the tensors the forward reads (policy.completion_logprobs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from grouprl.config import TrainConfig
from grouprl.distributed import DistContext
from grouprl.memory import CPU_BUDGET, micro_batch_rows
from grouprl.rollout import Rollout, same_prompt_ids
from grouprl.value import ValueTargets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateBatch:
    """What the optimizer steps of one training step read, for the whole (global) batch, on the host."""

    rollout: Rollout
    advantages: torch.Tensor         # [N], or [N, T] (one per token, process supervision)
    loss_mask: torch.Tensor          # [N, T] bool: the tokens the loss counts
    old_logp: torch.Tensor | None    # [N, T] the sampling policy's; None: on-policy (old = logp.detach())
    ref_logp: torch.Tensor | None    # [N, T] the reference's; None: beta = 0
    is_weights: torch.Tensor | None  # [N, T] sampler/trainer importance weights; None: no correction
    step: int = 0                    # the training step it belongs to (names it in log lines)
    values: ValueTargets | None = None  # PPO: V_old and the returns [N, T] (value.py); None: no value head

    def part(self, rows: torch.Tensor, T: int, device: torch.device) -> UpdatePart:
        """The micro-batch `rows  # [n]`, its first T columns, on `device`."""
        def take(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[rows, :T].to(device)

        advantages = self.advantages[rows].to(device) if self.advantages.dim() == 1 else take(self.advantages)
        v = self.values
        old_values, returns = (None, None) if v is None else (take(v.old_values), take(v.returns))
        return UpdatePart(self, rows, advantages, self.loss_mask[rows, :T].to(device), take(self.old_logp),
                          take(self.ref_logp), take(self.is_weights), old_values, returns)


@dataclass(frozen=True)
class UpdatePart:
    """One pass's rows of an `UpdateBatch`, trimmed to the pass's T' columns, on the model's device."""

    batch: UpdateBatch
    rows: torch.Tensor               # [n] rows of the batch
    advantages: torch.Tensor         # [n], or [n, T']
    loss_mask: torch.Tensor          # [n, T'] bool
    old_logp: torch.Tensor | None    # [n, T']
    ref_logp: torch.Tensor | None    # [n, T']
    is_weights: torch.Tensor | None  # [n, T']
    old_values: torch.Tensor | None = None  # [n, T'] PPO's V_old
    returns: torch.Tensor | None = None     # [n, T'] PPO's value targets

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This part of another [N, T] tensor of the batch: [n, T'] on the pass's device."""
        return x[self.rows, : self.loss_mask.shape[1]].to(self.loss_mask.device)

    def sampler_logp(self) -> torch.Tensor | None:
        """The log-probs the completions were sampled with [n, T']: the engine's own (vLLM), else the
        old policy's; None when on-policy."""
        sampled = self.batch.rollout.sampling_logp  # [N, T]
        return self.old_logp if sampled is None else self.take(sampled)


@dataclass
class MicroBatch:
    """A slice of a rollout, trimmed to its own longest prompt and completion. Each distinct
    prompt is stored once (u <= n): `prompt_index` says which one a completion continues."""

    prompt_ids: torch.Tensor       # [u, P'] left-padded
    prompt_mask: torch.Tensor      # [u, P']
    prompt_index: torch.Tensor     # [n] row -> its prompt
    completion_ids: torch.Tensor   # [n, T']
    completion_mask: torch.Tensor  # [n, T'] bool
    rows: torch.Tensor             # [n] rows of the rollout

    @staticmethod
    def from_rollout(rollout: Rollout, rows: torch.Tensor, share_min_tokens: int | None = None) -> MicroBatch:
        """`share_min_tokens`: store each distinct prompt once when that saves the forward pass at
        least this many tokens (n*P' - u*(P'-1)); None never does."""
        pm, cm = rollout.prompt_mask[rows], rollout.completion_mask[rows]  # [n, P], [n, T]
        pids = rollout.prompt_ids[rows]
        start = int((pm.sum(0) > 0).nonzero()[0]) if pm.any() else 0  # drop all-padding columns
        pids, pm = pids[:, start:], pm[:, start:]  # [n, P']
        T = max(1, int(cm.sum(-1).max()))
        n, index = len(rows), torch.arange(len(rows))
        if share_min_tokens is not None:
            inverse = same_prompt_ids(pids, pm)  # [n]
            u, width = int(inverse.max()) + 1, pids.shape[1]
            if u < n and n * width - u * (width - 1) >= share_min_tokens:
                first = torch.full((u,), n, dtype=torch.long).scatter_reduce(0, inverse, index, "amin")  # [u]
                pids, pm, index = pids[first], pm[first], inverse
        return MicroBatch(pids, pm, index, rollout.completion_ids[rows, :T], cm[:, :T], rows)

    def num_tokens(self, packed: bool) -> int:
        """Tokens the pass computes: packed, the real ones (each distinct prompt once); padded, n x (P' + T')."""
        if packed:
            return packed_tokens(self.prompt_mask.sum(-1).tolist(), self.completion_mask.sum(-1).tolist(),
                                 self.prompt_index.tolist())
        return len(self.completion_ids) * (self.prompt_ids.shape[1] + self.completion_ids.shape[1])

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids[self.prompt_index], self.completion_ids], dim=1)  # [n, P'+T']

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask[self.prompt_index], self.completion_mask.long()], dim=1)


def packed_tokens(prompt_lens: list[int], completion_lens: list[int], prompt_index: list[int]) -> int:
    """The length S of a packed row (packing.py): each distinct prompt once, plus every completion."""
    return sum(prompt_lens[j] for j in set(prompt_index)) + sum(completion_lens)


def plan_micro_batches(rollout: Rollout, order: torch.Tensor, max_rows: int, max_tokens: int | None = None,
                       packed: bool = False) -> tuple[list[torch.Tensor], int]:
    """`order  # [N]` cut into micro-batches of consecutive rows: at most `max_rows` rows, and with
    `max_tokens`, at most that many tokens as a pass computes them: padded, rows x (longest prompt
    + longest completion) of the micro-batch; `packed`, its real tokens, each distinct prompt once
    (`packed_tokens`). A row whose own prompt and completion exceed `max_tokens` forms a
    micro-batch alone. Returns the micro-batches and how many rows ran alone for being over the budget."""
    if max_tokens is None:
        return list(order.split(max_rows)), 0
    prompt_len = rollout.prompt_mask.sum(-1)[order].tolist()  # [N] in `order`
    completion_len = rollout.completion_mask.sum(-1).clamp(min=1)[order].tolist()
    group = rollout.prompt_groups()[order].tolist() if packed else [None] * len(order)
    batches, start, over = [], 0, 0
    tokens = p_max = t_max = 0  # the current micro-batch's cost and longest prompt and completion
    seen: set = set()  # its prompt groups (packed: each prompt is paid once)
    for i, (p, t, g) in enumerate(zip(prompt_len, completion_len, group)):
        if packed:
            cost = tokens + t + (p if g not in seen else 0)
        else:
            cost = (i - start + 1) * (max(p_max, p) + max(t_max, t))
        if i > start and (i - start == max_rows or cost > max_tokens):
            batches.append(order[start:i])
            start, seen, p_max, t_max, cost = i, set(), 0, 0, p + t  # the row opens the next one
        tokens, p_max, t_max = cost, max(p_max, p), max(t_max, t)
        seen.add(g)
        over += p + t > max_tokens
    batches.append(order[start:])
    return batches, over


def rank_share(ctx: DistContext, micro_batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, float]]:
    """This rank's share of the global micro-batches (r, r+K, ...) as (rows, loss weight), padded
    with weight-0 repeats so that every rank runs ceil(M / K) passes."""
    mine = [(rows, 1.0) for rows in micro_batches[ctx.rank::ctx.world_size]]
    passes = -(-len(micro_batches) // ctx.world_size)
    return mine + [(micro_batches[0], 0.0)] * (passes - len(mine))


class MicroBatchPlanner:
    """How this run cuts a batch into passes, with the settings fixed at start: `packed` (the passes
    run padding-free), `share_min_tokens` (a group's prompt is stored once when that saves at least
    this many tokens; None: never) and `auto_budget` (what `max_tokens_per_micro_batch: auto` means
    on this device, memory.py). The row and token limits are read from the config at each call."""

    def __init__(self, dist: DistContext, *, packed: bool, share_min_tokens: int | None,
                 auto_budget: int | None = None):
        self.dist, self.packed, self.share_min_tokens, self.auto_budget = dist, packed, share_min_tokens, auto_budget
        self._warned_over_budget = False  # a sequence above max_tokens_per_micro_batch was logged

    def budget(self, cfg: TrainConfig) -> int | None:
        """Tokens per pass: the config's number, or what `auto` means on this device."""
        budget = cfg.max_tokens_per_micro_batch
        if budget == "auto":
            return self.auto_budget or CPU_BUDGET
        return budget  # type: ignore[return-value]

    def plan(self, rollout: Rollout, cfg: TrainConfig) -> list[tuple[torch.Tensor, float]]:
        """This rank's micro-batches as (rows, loss weight); weight 0 marks a padding pass."""
        order = torch.argsort(rollout.lengths, stable=True)  # similar lengths share a micro-batch
        if self.share_min_tokens is not None:  # ... and a group's completions stay together: its prompt runs once
            group = rollout.prompt_groups()[order]
            order = order[torch.argsort(group, stable=True)]
        budget = self.budget(cfg)
        rows = micro_batch_rows(cfg.micro_batch_size, self.dist.device, len(order), self.dist.world_size, budget)
        batches, over = plan_micro_batches(rollout, order, rows, budget, packed=self.packed)
        if over and self.dist.is_main and not self._warned_over_budget:
            self._warned_over_budget = True  # once per run
            logger.warning("%d sequence(s) longer than max_tokens_per_micro_batch=%d ran alone in their pass: "
                           "raise the budget if memory allows", over, budget)
        return rank_share(self.dist, batches)

    def micro_batch(self, rollout: Rollout, rows: torch.Tensor) -> MicroBatch:
        """The tensors one pass over `rows` reads."""
        return MicroBatch.from_rollout(rollout, rows, self.share_min_tokens)
