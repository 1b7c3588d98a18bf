"""What the sampled completions of a step looked like, as metrics and rows.

- `SampleTally`: what the sampling stage saw over its rounds (groups, zero-variance groups,
  staleness, multi-turn counts) and its metrics;
- `batch_metrics`: rewards, advantages and completion lengths of the batch trained on;
- `completion_rows`: the first completions of that batch as samples.jsonl and the trackers show them.
- `EvalSums`: the sums behind `Trainer.evaluate`'s means (accuracy, reward, lengths, each function).

Metric names are the ones `metrics.jsonl` documents (README, "What a run writes").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.batch import StepBatch
from grouprl.rollout.types import trajectory_metrics


@dataclass
class SampleTally:
    """Sums over the generation rounds of one step (one round unless DAPO's dynamic sampling asks
    for more)."""

    rounds: int = 0
    groups: int = 0
    zero_std_groups: int = 0
    kept_groups: int = 0
    staleness: list[int] = field(default_factory=list)  # per generated completion
    overlapped: list[int] = field(default_factory=list)  # per completion: weight updates during its batch
    counts: dict[str, float] = field(default_factory=dict)  # multi-turn sums (Trajectories.counts)

    def add_round(self, num_completions: int, staleness: int, counts: dict[str, float], flat_groups: int,
                  num_groups: int, overlapped: int = 0) -> None:
        self.rounds += 1
        self.overlapped += [overlapped] * num_completions
        self.groups += num_groups
        self.zero_std_groups += flat_groups
        self.staleness += [staleness] * num_completions
        self.counts = {k: self.counts.get(k, 0.0) + v for k, v in counts.items()}

    def metrics(self, counts_over_ranks: dict[str, float], dynamic_sampling: bool,
                partial: bool = False) -> dict[str, float]:
        """`counts_over_ranks`: this tally's `counts` summed over ranks (the caller's collective)."""
        out = {"zero_std_frac": self.zero_std_groups / self.groups,
               "rollout/staleness_mean": sum(self.staleness) / len(self.staleness),
               "rollout/staleness_max": max(self.staleness)}
        if partial:  # completions whose generation a weight update overlapped
            out["rollout/partial_frac"] = sum(o > 0 for o in self.overlapped) / len(self.overlapped)
        out.update(trajectory_metrics(counts_over_ranks))  # multi-turn: tools, turns, stops
        if dynamic_sampling:
            out.update({"dynamic_sampling/rounds": self.rounds, "dynamic_sampling/kept_groups": self.kept_groups})
        return out


def batch_metrics(batch: StepBatch, advantages: torch.Tensor) -> dict[str, float]:
    """Rewards, advantages (per action token under process supervision) and completion lengths
    (the policy's own tokens) of the batch trained on."""
    lengths = batch.rollout.action_lengths.float()  # [N]
    adv = advantages[batch.rollout.action_mask] if advantages.dim() == 2 else advantages  # actions
    return {
        **batch.reward_metrics, **(batch.steps.metrics() if batch.steps else {}),
        "reward/mean": batch.rewards.mean().item(),
        "reward/std": batch.rewards.std().item() if len(batch.rewards) > 1 else 0.0,
        "advantage/mean": adv.mean().item(), "advantage/std": adv.std().item(),
        "advantage/min": adv.min().item(), "advantage/max": adv.max().item(),
        "completion/length_mean": lengths.mean().item(), "completion/length_min": lengths.min().item(),
        "completion/length_max": lengths.max().item(),
        "completion/truncated_frac": batch.rollout.truncated.float().mean().item(),
    }


class EvalSums:
    """Sums over the eval batches (and ranks) of the accuracy reward, the weighted reward, the
    lengths and each reward function's scores (NaN where a function abstained is left out)."""

    def __init__(self, reward_names: list[str], accuracy_reward: str):
        self.names, self.accuracy = reward_names, accuracy_reward
        self.sums = {"acc": 0.0, "acc_n": 0.0, "reward": 0.0, "length": 0.0}
        self.sums.update({f"{k}/{name}": 0.0 for name in reward_names for k in ("sum", "n")})

    def add(self, part: StepBatch) -> None:
        for name, scores in part.per_func.items():  # [n], NaN where the function abstained
            self.sums[f"sum/{name}"] += float(scores.nansum())
            self.sums[f"n/{name}"] += float((~scores.isnan()).sum())
        acc = part.per_func[self.accuracy]
        self.sums["acc"] += float(acc.nansum())
        self.sums["acc_n"] += float((~acc.isnan()).sum())
        self.sums["reward"] += float(part.rewards.sum())
        self.sums["length"] += float(part.rollout.action_lengths.sum())

    def result(self, sums: dict[str, float], num_samples: int, per_prompt: int = 1) -> dict[str, float]:
        """Means from `sums` (this object's `sums`, summed over ranks by the caller); `num_samples`
        prompts with `per_prompt` completions each."""
        completions = num_samples * per_prompt
        return {"accuracy": sums["acc"] / sums["acc_n"] if sums["acc_n"] else math.nan,
                "reward_mean": sums["reward"] / completions, "length_mean": sums["length"] / completions,
                "num_samples": num_samples,
                **{f"rewards/{n}": sums[f"sum/{n}"] / sums[f"n/{n}"] if sums[f"n/{n}"] else math.nan
                   for n in self.names}}


def completion_rows(batch: StepBatch, advantages: torch.Tensor, n: int) -> list[dict[str, Any]]:
    """The first `n` completions of a batch as samples.jsonl and the trackers' table show them: prompt,
    completion, the weighted reward and each function's score, advantage (under process supervision
    the mean over the completion's action tokens), length, stop reason (`eos`, `max_length`, or a
    multi-turn stop reason), and the tool calls of a multi-turn trajectory."""
    lengths = batch.rollout.action_lengths
    rows = []
    for i in range(min(n, len(batch.completions))):
        adv = advantages[i] if advantages.dim() == 1 else advantages[i][batch.rollout.action_mask[i]].mean()
        row = {"prompt": batch.prompts[i], "completion": batch.completions[i], "reward": float(batch.rewards[i]),
               **{f"rewards/{k}": float(v[i]) for k, v in batch.per_func.items()},
               **{f"audit/{k}": float(v[i]) for k, v in batch.audit.items()},
               "advantage": float(adv), "length": int(lengths[i]),
               "stop": batch.stop_reasons[i] if batch.stop_reasons else
               "max_length" if bool(batch.rollout.truncated[i]) else "eos"}
        if batch.tool_calls is not None:
            row["tool_calls"] = "; ".join(batch.tool_calls[i])
        rows.append(row)
    return rows
