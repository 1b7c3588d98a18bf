"""Evaluation that samples: pass@k, mean@k and maj@k next to the greedy accuracy.

`eval_metrics` names what `Trainer.evaluate` reports, all read from the accuracy reward
(`accuracy_reward`, default the first reward function); a completion counts as right when its
score is above 0 (as in preflight):
- `greedy`: the mean score of one greedy completion per prompt (`accuracy`);
- `mean@k`: the mean score of sampled completions: k of them per prompt, estimated without bias
  from all n = `num_generations_eval` samples (the mean over n);
- `pass@k`: the chance that at least one of k samples is right, with the unbiased estimator of
  Chen et al. (2021) from n >= k samples of which c are right: 1 - C(n-c, k) / C(n, k);
- `maj@k`: the vote of the first k samples: the answer most of them give (read by `answer_key`,
  math-verify's parse by default; ties go to the answer seen first; completions with no answer do
  not vote) is right if a completion that gave it is right.
Sampled completions use `eval_temperature` (default: the training temperature) and their own
seeded random stream, so an evaluation never changes what training samples afterwards.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c right: 1 - C(n-c, k)/C(n, k) (1 when n - c < k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_right(answers: list[Any], right: list[bool]) -> bool:
    """The vote of `answers` (None: no answer, no vote) and whether a completion that gave the winning
    answer is right."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)  # first seen among the tied
    return any(r for a, r in zip(answers, right) if a == winner)


def math_answer_key(text: str) -> str | None:
    """The answer math-verify reads from a completion, as a string (None when it reads none)."""
    from math_verify import parse

    parsed = parse(text)
    if not parsed:
        return None
    return str(parsed[-1]) if isinstance(parsed[-1], str) else str(parsed[0])


class SampledSums:
    """Per-prompt sums behind the sampled metrics (summed over batches and ranks, then `result`)."""

    def __init__(self, metrics: list[tuple[str, int]], n: int, answer_key: Callable[[str], Any] = math_answer_key):
        self.metrics, self.n, self.answer_key = [m for m in metrics if m[0] != "greedy"], n, answer_key
        self.sums = {f"{kind}@{k}": 0.0 for kind, k in self.metrics}
        self.sums["prompts"] = 0.0

    def add(self, scores: list[float], texts: list[str]) -> None:
        """The n samples of one prompt: their accuracy scores (NaN: the function abstained) and texts."""
        right = [s == s and s > 0 for s in scores]
        answers = [self.answer_key(t) for t in texts] if any(k == "maj" for k, _ in self.metrics) else []
        for kind, k in self.metrics:
            if kind == "mean":
                scored = [s for s in scores if s == s]
                value = sum(scored) / len(scored) if scored else 0.0
            elif kind == "pass":
                value = pass_at_k(self.n, sum(right), k)
            else:
                value = float(majority_right(answers[:k], right[:k]))
            self.sums[f"{kind}@{k}"] += value
        self.sums["prompts"] += 1

    def result(self, sums: dict[str, float]) -> dict[str, float]:
        prompts = max(sums["prompts"], 1.0)
        return {k: v / prompts for k, v in sums.items() if k != "prompts"}
