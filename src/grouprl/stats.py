"""The sums behind the update's and evaluation's means: each is summed locally, over ranks by the
caller, then turned into means.

- `UpdateSums`: the loss statistics of the micro-batches of one optimizer step, token-weighted;
- `EvalSums`: the sums behind `Trainer.evaluate`'s means.

Metric names are the ones `metrics.jsonl` documents (README, "What a run writes").
"""

from __future__ import annotations

import math

from grouprl.batch import StepBatch


class UpdateSums:
    """Loss statistics of one optimizer step: each micro-batch's means weighted by its real tokens,
    the loss summed, the entropy summed over action tokens."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {"tokens": 0.0, "loss": 0.0}

    def add(self, weight: float, loss: float, stats: dict[str, float], entropy_sum: float | None) -> None:
        """`weight` is the micro-batch's loss weight (0 for a padding pass); `stats` are
        `policy_loss`'s means over its `num_tokens` real tokens."""
        stats = dict(stats)
        self.sums["loss"] += weight * loss
        n = weight * int(stats.pop("num_tokens"))
        self.sums["tokens"] += n
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * n
        if entropy_sum is not None:
            self.sums["entropy"] = self.sums.get("entropy", 0.0) + weight * entropy_sum

    def result(self, reduced: dict[str, float], action_tokens: int, grad_norm: float) -> dict[str, float]:
        """Means from `reduced` (this object's `sums`, summed over ranks by the caller)."""
        sums = dict(reduced)
        tokens, loss_total = sums.pop("tokens"), sums.pop("loss")
        out = {k: v / max(tokens, 1) for k, v in sums.items() if k != "entropy"}
        if "entropy" in sums:
            out["entropy"] = sums["entropy"] / max(action_tokens, 1)
        return {**out, "loss": loss_total, "grad_norm": grad_norm}


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
