"""Evaluation that samples: pass@k, mean@k and maj@k next to the greedy accuracy.

`eval_metrics` names what `Trainer.evaluate` reports, all read from the accuracy reward
(`accuracy_reward`, default the first reward function); `greedy` and `mean@k` average its scores,
and for `pass@k` and `maj@k` a completion counts as right when its score is above 0 (as in preflight):
- `greedy`: the mean score of one greedy completion per prompt (`accuracy`);
- `mean@k`: the mean score of sampled completions: k of them per prompt, estimated without bias
  from all n = `num_generations_eval` samples (the mean over n);
- `pass@k`: the chance that at least one of k samples is right, with the unbiased estimator of
  Chen et al. (2021) from n >= k samples of which c are right: 1 - C(n-c, k) / C(n, k);
- `maj@k`: the vote of the first k samples: the answer most of them give (read by `answer_key`,
  by default as `math_accuracy` reads it; ties go to the answer seen first; completions with no
  answer do not vote) is right if a completion that gave it is right.
A sample the accuracy reward does not score (None, e.g. a gold answer it cannot parse) is left out
as `accuracy` leaves it out: the sampled metrics read a prompt's scored samples (n of them above),
and a prompt is counted in a metric only when it has enough of them (mean@k: one; pass@k: k; maj@k:
one among the first k, and only scored samples vote).
Sampled completions use `eval_temperature` (default: the training temperature) and their own
seeded random stream, so an evaluation never changes what training samples afterwards.
Under torchrun every rank runs as many batches as the rank with the most prompts: generating may
be a collective (FSDP2 gathers the weights), so a rank out of prompts generates for a stand-in
prompt whose completions are not scored.

`BestModel` follows `metric_for_best_model` from eval to eval: the best result and its checkpoint.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from datasets import Dataset

from grouprl import distributed as D
from grouprl.batch import StepBatch
from grouprl.checkpoint import checkpoint_path
from grouprl.config import ConfigError, TrainConfig, did_you_mean, parse_eval_metric
from grouprl.data import PromptBatch
from grouprl.rewards.math import read_answer
from grouprl.rollout.types import Trajectories
from grouprl.sample_stats import EvalSums


class SamplingStages(Protocol):
    """The trainer's public stages that sample and score (grouprl.trainer.Trainer has them): what
    evaluation and preflight run, typed, without importing the trainer."""

    cfg: TrainConfig
    dist: D.DistContext

    def prompts(self, rows: Dataset | list[Any]) -> PromptBatch: ...

    def generate(self, prompts: PromptBatch, *, num_generations: int | None = None, greedy: bool = False,
                 temperature: float | None = None, generator: torch.Generator | None = None) -> Trajectories: ...

    def score(self, prompts: PromptBatch, trajectories: Trajectories) -> StepBatch: ...


class EvalStages(SamplingStages, Protocol):
    """What `run_evaluation` uses: the sampling stages, and the reward functions' names."""

    reward_names: list[str]


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


def math_answer_key(text: str) -> Fraction | str | None:
    """The answer `math_accuracy` reads from a completion (rewards/math.py: the <answer> tag, box or
    "####", then its reading of numbers), as a vote: a number as its exact value ("1,000" and "1000",
    "\\frac{1}{2}" and "0.5" vote together), any other expression as math-verify's canonical string;
    None when it reads none."""
    values, parsed = read_answer(text)  # [exact values], math-verify's parse
    if values:
        return values[0]  # a percentage's value as written: "50%" votes with 50
    if not parsed:
        return None
    expr = parsed[0]
    return Fraction(int(expr.p), int(expr.q)) if getattr(expr, "is_Rational", False) else str(expr)


class SampledSums:
    """Per-prompt sums behind the sampled metrics, each with the count of prompts it holds (summed over
    batches and ranks, then `result`)."""

    def __init__(self, metrics: list[tuple[str, int]], answer_key: Callable[[str], Any] = math_answer_key):
        self.metrics, self.answer_key = [m for m in metrics if m[0] != "greedy"], answer_key
        self.sums = {f"{kind}@{k}{part}": 0.0 for kind, k in self.metrics for part in ("", "/prompts")}

    def add(self, scores: list[float], texts: list[str]) -> None:
        """The n samples of one prompt: their accuracy scores (NaN: the function abstained) and texts.
        A metric counts the prompt when enough of its samples are scored (module docstring)."""
        scored = [s for s in scores if s == s]  # NaN: unscored
        right = [s == s and s > 0 for s in scores]
        vote = any(kind == "maj" for kind, _ in self.metrics)
        answers = [self.answer_key(t) if s == s else None for t, s in zip(texts, scores)] if vote else []
        for kind, k in self.metrics:
            if kind == "mean" and scored:
                value = sum(scored) / len(scored)
            elif kind == "pass" and len(scored) >= k:
                value = pass_at_k(len(scored), sum(right), k)
            elif kind == "maj" and any(s == s for s in scores[:k]):
                value = float(majority_right(answers[:k], right[:k]))
            else:
                continue
            self.sums[f"{kind}@{k}"] += value
            self.sums[f"{kind}@{k}/prompts"] += 1

    def result(self, sums: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over the prompts it counted (NaN where it counted none)."""
        return {f"{kind}@{k}": sums[f"{kind}@{k}"] / n if (n := sums[f"{kind}@{k}/prompts"]) else math.nan
                for kind, k in self.metrics}


def accuracy_reward_name(accuracy_reward: str | None, reward_names: list[str]) -> str:
    """The reward function the accuracy is read from: `accuracy_reward`, else the first one."""
    return accuracy_reward or reward_names[0]


@torch.no_grad()
def run_evaluation(trainer: EvalStages, ds: Dataset, batch_size: int) -> dict[str, float]:
    """`Trainer.evaluate`: greedy and sampled completions of this rank's share of `ds` (every K-th
    prompt), scored by the trainer's reward functions, summed over ranks."""
    cfg, K = trainer.cfg, trainer.dist.world_size
    metrics = [parse_eval_metric(m) for m in cfg.eval_metrics]
    greedy, n = any(kind == "greedy" for kind, _ in metrics), cfg.num_generations_eval
    accuracy = accuracy_reward_name(cfg.accuracy_reward, trainer.reward_names)
    sampled = SampledSums(metrics) if len(metrics) > greedy else None
    rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7_919 + trainer.dist.rank)  # its own stream
    mine = list(range(trainer.dist.rank, len(ds), K))
    sums = EvalSums(trainer.reward_names, accuracy)
    for start in range(0, math.ceil(len(ds) / K), batch_size):  # rank 0's batches, on every rank
        rows = mine[start:start + batch_size]
        prompts = trainer.prompts(ds.select(rows or [0]))  # out of prompts: a stand-in, generated, not scored
        greedy_out = trainer.generate(prompts, greedy=True) if greedy else None
        sampled_out = None if sampled is None else trainer.generate(
            prompts, num_generations=n, temperature=cfg.eval_temperature, generator=rng)
        if not rows:
            continue
        if greedy_out is not None:
            sums.add(trainer.score(prompts, greedy_out))
        if sampled_out is not None:
            part = trainer.score(prompts, sampled_out)
            if not greedy:
                sums.add(part)
            scores = part.per_func[accuracy].tolist()  # [B * n], n per prompt in prompt order
            for i in range(len(prompts.prompts)):
                sampled.add(scores[i * n:(i + 1) * n], part.completions[i * n:(i + 1) * n])
    out = sums.result(D.all_reduce_sums(trainer.dist, sums.sums), len(ds), per_prompt=1 if greedy else n)
    if sampled is not None:
        out.update(sampled.result(D.all_reduce_sums(trainer.dist, sampled.sums)))
    return out


def check_eval_names(cfg: TrainConfig, has_eval_set: bool, reward_names: list[str]) -> None:
    """Before any model loads, the names that the reward functions give meaning to: `accuracy_reward` is
    one of them, and `metric_for_best_model` needs an eval set and, as `rewards/NAME`, names one of them
    (else a typo surfaced at the first eval that read it: after the whole run, with `eval_steps: 0`)."""
    metric = cfg.metric_for_best_model
    if metric and not has_eval_set:
        raise ConfigError(f"metric_for_best_model={metric!r} needs an eval set: set eval_data (or eval_fraction)")
    if cfg.accuracy_reward and cfg.accuracy_reward not in reward_names:
        raise ConfigError(f"accuracy_reward={cfg.accuracy_reward!r} is not one of the reward functions {reward_names}")
    if metric and metric.startswith("rewards/") and metric.removeprefix("rewards/") not in reward_names:
        results = [f"rewards/{name}" for name in reward_names]
        raise ConfigError(f"metric_for_best_model={metric!r} names no reward function: the eval reports "
                          f"{', '.join(results)}" + did_you_mean(metric, results))


class BestModel:
    """metric_for_best_model: the best eval so far, `record` = {step, metric, value} (None before the
    first eval, and always when no metric is set); checkpoints in `output_dir`. The record names the
    checkpoint by its step, not its path: a run folder moved and resumed still finds it."""

    def __init__(self, metric: str | None, greater_is_better: bool, output_dir: str):
        self.metric, self.greater_is_better, self.output_dir = metric, greater_is_better, output_dir
        self.record: dict[str, Any] | None = None

    def update(self, result: dict[str, float], step: int) -> bool:
        """Whether `result`, the eval at `step`, is the best so far: it improves on the record (ties
        keep the earlier). If so it becomes the record, and the caller writes the step's checkpoint."""
        if not self.metric:
            return False
        if self.metric not in result:
            raise ConfigError(f"metric_for_best_model={self.metric!r} is not an eval result; they are "
                              f"{', '.join(sorted(k for k in result if k not in ('seconds', 'num_samples')))}")
        value, best = result[self.metric], self.record
        if not math.isfinite(value) or (best is not None and not (
                value > best["value"] if self.greater_is_better else value < best["value"])):
            return False
        self.record = {"step": step, "metric": self.metric, "value": value}
        return True

    @property
    def checkpoint(self) -> Path | None:
        """The best checkpoint's folder in the current output_dir (None without a record)."""
        return None if self.record is None else checkpoint_path(self.output_dir, self.record["step"])

    def summary(self) -> dict[str, Any]:
        """summary.json's `best_checkpoint` (the record and its folder), or nothing without a record."""
        return {} if self.record is None else {"best_checkpoint": {**self.record, "checkpoint": str(self.checkpoint)}}
