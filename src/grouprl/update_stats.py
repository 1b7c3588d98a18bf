"""The loss statistics of one optimizer step (`UpdateSums`): each micro-batch's means weighted by its
real tokens, summed locally and over ranks by the caller, then turned into means. Metric names are the
ones `metrics.jsonl` documents (README, "What a run writes")."""

from __future__ import annotations


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
