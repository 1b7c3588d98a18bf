"""`StepBatch`: the completions one step trains on, scored, as they travel from the rewards stage
to the update (and between ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl import distributed as D
from grouprl.core import zero_std_groups, zero_std_step_groups
from grouprl.rewards import ProcessRewards, reward_metrics
from grouprl.rollout import Rollout


@dataclass
class StepBatch:
    """The completions one step trains on, with everything the rewards saw."""

    rollout: Rollout
    prompts: list[Any]              # [N] prompt of each completion
    completions: list[str]          # [N] decoded completion text
    rewards: torch.Tensor           # [N] weighted sum over reward functions
    per_func: dict[str, torch.Tensor]  # name -> [N]
    reward_metrics: dict[str, float]  # of these N rows, recomputed when the batch is cut or joined
    steps: ProcessRewards | None = None  # token-level step rewards (advantage_estimator: process)
    audit: dict[str, torch.Tensor] = field(default_factory=dict)  # audit function -> [N], never in the reward
    prompt_index: list[int] | None = None  # [N] each completion's prompt row in its dataset
    stop_reasons: list[str] | None = None  # [N] multi-turn: why each trajectory stopped (rollout.STOP_REASONS)
    tool_calls: list[list[str]] | None = None  # [N] multi-turn: the calls each made, as name(arguments)
    outcome: torch.Tensor | None = None  # [N] the weighted sum before overlong shaping; None: not shaped
    fallback: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N] bool, rows given reward_fallback

    @property
    def unshaped(self) -> torch.Tensor:
        """[N] the reward before overlong shaping: what decides whether a group is flat (DAPO's dynamic
        sampling and the prompt filter judge the answers, not their lengths)."""
        return self.rewards if self.outcome is None else self.outcome

    def flat_groups(self, group_size: int) -> torch.Tensor:
        """Bool [B]: the groups without learning signal, judged before overlong shaping. Under process
        supervision a group is flat only when all its step rewards (the outcome included) are equal, the
        test `process_advantages` uses: equal per-completion means of unequal steps still teach."""
        if self.steps is not None:
            return zero_std_step_groups(self.steps.with_outcome(shaped=False)[0], group_size)
        return zero_std_groups(self.unshaped, group_size)

    def select(self, rows: torch.Tensor) -> StepBatch:
        """The given rows; their reward metrics are theirs (dynamic sampling logs those of the groups kept)."""
        r = rows.tolist()
        per_func = {k: v[rows] for k, v in self.per_func.items()}
        fallback = {k: v[rows] for k, v in self.fallback.items()}
        return StepBatch(self.rollout.select(rows), [self.prompts[i] for i in r],
                         [self.completions[i] for i in r], self.rewards[rows], per_func,
                         reward_metrics(per_func, fallback),
                         None if self.steps is None else self.steps.select(rows),
                         {k: v[rows] for k, v in self.audit.items()},
                         None if self.prompt_index is None else [self.prompt_index[i] for i in r],
                         None if self.stop_reasons is None else [self.stop_reasons[i] for i in r],
                         None if self.tool_calls is None else [self.tool_calls[i] for i in r],
                         None if self.outcome is None else self.outcome[rows], fallback)

    @staticmethod
    def gather(dist: D.DistContext, local: StepBatch, pad_token_id: int) -> StepBatch:
        """Every rank's scored completions, in rank order (= prompt order), on every rank."""
        if not dist.enabled:
            return local
        return StepBatch.cat(D.gather_objects(dist, local), pad_token_id)

    @staticmethod
    def cat(parts: list[StepBatch], pad_token_id: int) -> StepBatch:
        """Join batches; the reward metrics are those of the joined rows."""
        per_func = {k: torch.cat([p.per_func[k] for p in parts]) for k in parts[0].per_func}
        fallback = {k: torch.cat([p.fallback[k] for p in parts]) for k in parts[0].fallback}
        return StepBatch(Rollout.cat([p.rollout for p in parts], pad_token_id),
                         [x for p in parts for x in p.prompts],
                         [x for p in parts for x in p.completions],
                         torch.cat([p.rewards for p in parts]), per_func,
                         reward_metrics(per_func, fallback),
                         None if parts[0].steps is None else ProcessRewards.cat([p.steps for p in parts]),
                         {k: torch.cat([p.audit[k] for p in parts]) for k in parts[0].audit},
                         None if parts[0].prompt_index is None else [i for p in parts for i in p.prompt_index],
                         None if parts[0].stop_reasons is None else [x for p in parts for x in p.stop_reasons],
                         None if parts[0].tool_calls is None else [x for p in parts for x in p.tool_calls],
                         None if parts[0].outcome is None else torch.cat([p.outcome for p in parts]), fallback)
