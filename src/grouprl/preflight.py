"""Preflight: will GRPO learn from this config? Measured on the starting policy, before any update.

A group of G completions teaches only when its rewards differ: an all-equal group has zero
advantage (core/advantages.py, `zero_std_groups`). `run` samples n completions (the config's G, or
a multiple m*G) for N training prompts through the trainer's public stages (`prompts`, `generate`,
`score`, `logprobs`), with the config's sampling and engine, and reports, per reward function and
for the weighted total: the mean, the pass rate, the share of all-equal groups at the config's G
and the share predicted for other G; prompts too easy / too hard; within-group correlations of
the functions; completion lengths; time per step and per run; recommendations with their reasons.
It writes preflight.json and preflight.png into output_dir (nothing else: an output_dir holding a
run's checkpoints is left as it is).

Definitions and choices:
- a pass is a score > 0 (`PASS_ABOVE`): accuracy and format functions give a positive score for a
  success and 0 or a penalty otherwise. A threshold at "the best score seen" was rejected: when no
  completion succeeds, the best seen is the failure score and every prompt would look solved.
  An abstention (None, NaN) is not a pass; it adds 0 to the total (weighted nansum), so the
  variance statistics read it as 0, its contribution;
- the predicted all-equal probability of a prompt at group size G is sum_v p_v^G over the distinct
  scores v it gets with probability p_v (for a binary reward, p^G + (1-p)^G). From k_v of n
  samples scoring v, sum_v C(k_v, G) / C(n, G) is unbiased for G <= n (the share of the G-subsets
  of the n samples that are all equal); for G > n only the plug-in sum_v (k_v/n)^G exists, which
  overestimates the all-equal share (a prompt never solved in n samples counts as never solved at
  any G, so with n = G a larger G can never look better). The estimator used is named per G in
  the report; sampling n = m*G per prompt (`--samples`) makes the predictions unbiased up to n.
  Equality is exact, as in training. The observed share at the config's G counts the m groups of
  G consecutive samples of each prompt, as training would draw them;
- under torchrun every rank samples its contiguous share of each step-sized chunk of prompts
  (whole groups, as a training step does), the scored chunks are gathered on every rank, every
  rank computes the same report (so `--strict` exits alike everywhere), rank 0 writes;
- time per step: generation and rewards are measured per step-sized chunk of prompts, as seconds
  per completion (the median over chunks, which resists the first call's warm-up) times a step's
  B*G completions. Batching is sublinear, so this is an overestimate when a chunk holds fewer
  completions than a step (fewer prompts than prompts_per_step) and an underestimate when it
  holds more (--samples above G). The update is estimated from one measured log-prob pass over
  the first chunk's completions, scaled the same way (`trainer.logprobs`, which changes no
  weight): a training pass costs ~3 forward passes (backward ~ 2x forward), 4 with
  gradient_checkpointing: true, times num_iterations, plus one pass for reference log-probs
  (beta > 0) and one for old log-probs (num_iterations > 1, or the sampler correction). With
  dynamic sampling, generation and rewards repeat for the expected number of rounds of the
  trainer's loop (`expected_sampling_rounds`: whole rounds of B prompts until B groups taught, at
  most max_sampling_rounds), each group teaching at the measured share. 1/(teaching share)
  underestimates it: at B = 16 and 64 % it is 1.56, not the trainer's 2.03, since the last round
  is a whole one. Weight sync, evaluation and checkpoints are not counted.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from datasets import Dataset

from grouprl import distributed as D
from grouprl.batch import StepBatch
from grouprl.core import zero_std_groups
from grouprl.evaluation import SamplingStages
from grouprl.memory import checkpoint_mode
from grouprl.rollout import Rollout

PASS_ABOVE = 0.0  # a score above this is a pass (module docstring: why not "the best score seen")
GROUP_SIZES = (4, 8, 16, 32)  # predicted zero-variance shares are reported at these G (and the config's)
LOW_TEACHING = 0.5  # fewer groups than this teaching at the config's G: worth a larger G if it helps
RAISE_G_GAIN = 0.1  # ... and a larger G must add this much teaching share to be recommended
SKEWED_PROMPTS = 0.3  # this share of prompts too easy (or too hard) calls for a prompt filter
MAX_TRUNCATION = 0.1  # more completions than this cut at max_completion_length: raise it
OPPOSED = -0.3  # within-group correlation below this: two reward functions pull against each other


# ---------------------------------------------------------------------- statistics (pure)
def all_equal_probability(scores: torch.Tensor, G: int) -> tuple[torch.Tensor, str]:
    """Per prompt, the probability that G fresh completions all score the same [B], from the n
    observed scores of each prompt `scores` [B, n], and the estimator used ("unbiased" for G <= n,
    "plug-in" otherwise; module docstring)."""
    n = scores.shape[1]
    probs = []
    for row in scores.tolist():  # [n] exact values: equality as in zero_std_groups
        counts = Counter(v for v in row if v == v).values()  # k_v per distinct score v; NaN equals nothing
        if G <= n:
            probs.append(sum(math.comb(k, G) for k in counts) / math.comb(n, G))
        else:
            probs.append(sum((k / n) ** G for k in counts))
    return torch.tensor(probs, dtype=torch.float64), "unbiased" if G <= n else "plug-in"  # [B]


def predicted_zero_variance(scores: torch.Tensor, sizes: list[int]) -> dict[int, tuple[float, str]]:
    """G -> (predicted share of all-equal groups, estimator) from `scores` [B, n]: the mean over
    prompts of `all_equal_probability`."""
    out = {}
    for G in sizes:
        probs, estimator = all_equal_probability(scores, G)  # [B]
        out[G] = (float(probs.mean()), estimator)
    return out


def pass_counts(scores: torch.Tensor) -> torch.Tensor:
    """Passes per prompt [B] from `scores` [B, n] (NaN, an abstention, is no pass)."""
    return (scores > PASS_ABOVE).sum(dim=1)  # [B]


def difficulty(passes: torch.Tensor, n: int) -> dict[str, Any]:
    """Prompts by their passes [B] out of n samples: too easy (all n), too hard (none),
    informative; and the histogram of passes (index k: prompts with k passes)."""
    B = len(passes)
    easy, hard = int((passes == n).sum()), int((passes == 0).sum())
    return {"too_easy": easy / B, "too_hard": hard / B, "informative": (B - easy - hard) / B,
            "pass_count_histogram": torch.bincount(passes, minlength=n + 1).tolist()}


def within_group_correlation(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Pearson correlation of two reward functions' scores [B, n] after removing each prompt's mean:
    what the advantages see. Negative: within a group, what one rewards the other penalises. None
    when either is constant within every group."""
    a = a.double() - a.double().mean(dim=1, keepdim=True)  # [B, n]
    b = b.double() - b.double().mean(dim=1, keepdim=True)  # [B, n]
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / den if den > 0 else None


def length_stats(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """Completion lengths [N] (tokens the policy sampled) and the truncated share [N] bool."""
    x = lengths.double()
    return {"mean": float(x.mean()), "p50": float(x.quantile(0.5)), "p90": float(x.quantile(0.9)),
            "max": int(lengths.max()), "truncation_rate": float(truncated.double().mean())}


def update_passes(num_iterations: int, reference: bool, old_logprobs: bool, checkpointing: bool,
                  teacher: bool = False, values: bool = False) -> int:
    """An update's cost in forward passes over the step's completions (module docstring): with a
    teacher (distillation) its log-prob pass too, and with a value head (PPO) the pass for V_old."""
    return num_iterations * (4 if checkpointing else 3) + int(reference) + int(old_logprobs) + int(teacher) \
        + int(values)


def groups_carry_the_signal(cfg: Any) -> bool:
    """Whether a group whose rewards are all equal teaches nothing: under GRPO-style group baselines,
    yes; with PPO's value head (the baseline is V, not the group) or a teacher (every token is scored
    against it) such groups still teach, so the teaching share is for information only."""
    return not cfg.value_head and not (cfg.distill_coef or 0) > 0


# ---------------------------------------------------------------------- samples
@dataclass
class Samples:
    """What preflight measured: n completions for each of B prompts (all ranks' rows)."""

    per_func: dict[str, torch.Tensor]  # name -> [B, n], NaN where the function abstained
    total: torch.Tensor                # [B, n] the weighted reward, before overlong shaping (what decides a
                                       # group's signal: dynamic sampling and zero_std_frac judge it)
    lengths: torch.Tensor              # [B*n] tokens the policy sampled
    truncated: torch.Tensor            # [B*n] bool
    chunk_prompts: list[int]           # prompts of each step-sized chunk
    generate_s: list[float]            # per chunk, the slowest rank
    reward_s: list[float]              # per chunk, the slowest rank
    forward_s: float                   # one log-prob pass over the first chunk's completions
    flat: torch.Tensor | None = None   # [B*n/G] the groups of G training would call flat (StepBatch.flat_groups:
                                       # under process supervision, by their steps); None: judged on `total`
    equal_as: torch.Tensor | None = None  # [B, n] under process supervision, what a group's flatness compares
                                       # (`step_keys`); None: `total`


def step_keys(steps: list[list[float]]) -> torch.Tensor:
    """Per completion [N], a value equal between two completions exactly when a group of them alone would
    be flat under process supervision (all their step rewards equal, `zero_std_step_groups`): its steps'
    common value when they are all equal, else NaN, equal to nothing (`all_equal_probability`). A group is
    then flat when its keys are all equal, and the all-equal predictions apply to the keys."""
    return torch.tensor([float(r[0]) if r and len(set(r)) == 1 else math.nan for r in steps], dtype=torch.float64)


class PreflightStages(SamplingStages, Protocol):
    """What preflight uses of the trainer (grouprl.trainer.Trainer; only the cli imports it): the
    sampling stages, the training set, the tokenizer's padding and the no-grad log-prob pass."""

    train_ds: Dataset
    tokenizer: Any  # a transformers tokenizer: its pad_token_id

    def logprobs(self, rollout: Rollout, *, reference: bool = False) -> torch.Tensor: ...


def check_counts(num_prompts: int, samples_per_prompt: int | None, G: int) -> int:
    """The samples per prompt (default G), after checking both counts."""
    if num_prompts < 1:
        raise ValueError(f"--prompts {num_prompts}: preflight needs at least one prompt; pass --prompts N "
                         "with N >= 1 (default 64)")
    n = samples_per_prompt or G
    if n < G or n % G:
        raise ValueError(f"--samples {n}: sample whole groups, a multiple of num_generations={G} "
                         f"(e.g. {G} or {4 * G})")
    return n


def sample(trainer: PreflightStages, num_prompts: int, samples_per_prompt: int | None = None) -> Samples:
    """n completions each (default G), scored, for `num_prompts` training prompts drawn with the
    config's seed (the trainer's prompt sampler is left alone), in chunks of prompts_per_step."""
    cfg, dist, ds = trainer.cfg, trainer.dist, trainer.train_ds
    samples = check_counts(num_prompts, samples_per_prompt, cfg.num_generations)
    n = min(num_prompts, len(ds))
    n -= n % dist.world_size  # every rank samples whole groups of the same number of prompts
    if n == 0 and num_prompts < dist.world_size:
        raise ValueError(f"--prompts {num_prompts} is fewer than the {dist.world_size} processes (each samples "
                         f"whole groups of its share): use --prompts {dist.world_size} or more")
    if n == 0:
        raise ValueError(f"the training set has {len(ds)} prompts, fewer than the {dist.world_size} "
                         "processes: run preflight with fewer processes")
    indices = random.Random(cfg.seed).sample(range(len(ds)), n)
    parts, chunks, gen_s, reward_s, forward_s = [], [], [], [], 0.0
    for start in range(0, n, cfg.prompts_per_step):
        chunk = indices[start:start + cfg.prompts_per_step]
        prompts = trainer.prompts(ds.select(D.shard_prompts(dist, chunk)))
        t0 = time.perf_counter()
        trajectories = trainer.generate(prompts, num_generations=samples)
        t1 = time.perf_counter()
        local = trainer.score(prompts, trajectories)
        t2 = time.perf_counter()
        gathered = D.gather_objects(dist, (local, t1 - t0, t2 - t1))
        batch = StepBatch.cat([g[0] for g in gathered], trainer.tokenizer.pad_token_id)
        if not parts:  # one step's log-prob pass: the unit of the update estimate
            t0 = time.perf_counter()
            trainer.logprobs(batch.rollout)
            forward_s = time.perf_counter() - t0
        parts.append(batch)
        chunks.append(len(chunk))
        gen_s.append(max(g[1] for g in gathered))
        reward_s.append(max(g[2] for g in gathered))
    return Samples({k: torch.cat([p.per_func[k] for p in parts]).view(-1, samples) for k in parts[0].per_func},
                   torch.cat([p.unshaped for p in parts]).view(-1, samples),
                   torch.cat([p.rollout.action_lengths for p in parts]),
                   torch.cat([p.rollout.truncated for p in parts]), chunks, gen_s, reward_s, forward_s,
                   torch.cat([p.flat_groups(cfg.num_generations) for p in parts]),
                   None if parts[0].steps is None else step_keys(
                       [r for p in parts for r in p.steps.with_outcome(shaped=False)[0]]).view(-1, samples))


# ---------------------------------------------------------------------- the report
def summarize(s: Samples, cfg: Any, device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """The report (preflight.json) from the samples and the TrainConfig."""
    (B, n), G = s.total.shape, cfg.num_generations
    sizes = sorted(set(GROUP_SIZES) | {G})
    rewards = {}
    for name, scores in s.per_func.items():  # [B, n]
        contribution = torch.nan_to_num(scores, nan=0.0)  # [B, n] an abstention adds 0 to the total
        rewards[name] = {"mean": _finite(scores.nanmean()), "pass_rate": float(pass_counts(scores).sum()) / (B * n),
                         "zero_variance_share": float(zero_std_groups(contribution.view(-1), G).double().mean()),
                         "predicted_zero_variance_share": _shares(predicted_zero_variance(contribution, sizes))}
    predicted = predicted_zero_variance(s.total if s.equal_as is None else s.equal_as, sizes)
    flat = s.flat if s.flat is not None else zero_std_groups(s.total.view(-1), G)
    zero_var = float(flat.double().mean())
    accuracy = cfg.accuracy_reward or next(iter(s.per_func))
    names = list(s.per_func)
    correlations = [{"a": a, "b": b, "r": within_group_correlation(torch.nan_to_num(s.per_func[a], nan=0.0),
                                                                   torch.nan_to_num(s.per_func[b], nan=0.0))}
                    for i, a in enumerate(names) for b in names[i + 1:]]
    report = {
        "num_prompts": B, "num_generations": G, "samples_per_prompt": n, "num_completions": B * n,
        "pass_definition": f"score > {PASS_ABOVE:g}; an abstention is not a pass",
        "estimators": {str(g): e for g, (_, e) in predicted.items()},
        "rewards": rewards,
        "total": {"mean": float(s.total.double().mean()), "zero_variance_share": zero_var,
                  "teaching_share": 1.0 - zero_var, "predicted_zero_variance_share": _shares(predicted)},
        "difficulty": {"reward": accuracy, **difficulty(pass_counts(s.per_func[accuracy]), n)},
        "correlations": correlations,
        "lengths": {**length_stats(s.lengths, s.truncated), "max_completion_length": cfg.max_completion_length},
        "timing": _timing(s, cfg, 1.0 - zero_var, device),
        "groups_carry_the_signal": groups_carry_the_signal(cfg),
    }
    report["recommendations"] = recommendations(report, cfg.temperature)
    return report


def _timing(s: Samples, cfg: Any, teaching: float, device: torch.device) -> dict[str, Any]:
    """Tokens/s of generation and the expected seconds per step and per run (module docstring)."""
    n = s.total.shape[1]
    step_completions = cfg.prompts_per_step * cfg.num_generations
    completions = [c * n for c in s.chunk_prompts]  # per chunk
    gen = statistics.median(t / c for t, c in zip(s.generate_s, completions)) * step_completions
    reward = statistics.median(t / c for t, c in zip(s.reward_s, completions)) * step_completions
    rounds = 1.0
    if cfg.dynamic_sampling:  # DAPO generates again until B groups teach
        rounds = expected_sampling_rounds(cfg.prompts_per_step, teaching, cfg.max_sampling_rounds)
    corrects = cfg.use_vllm and cfg.vllm_importance_sampling_correction is not False  # vLLM's log-probs kept
    distills = (cfg.distill_coef or 0) > 0  # d = log pi_T - log pi_old: the old log-probs are computed
    passes = update_passes(cfg.num_iterations, cfg.beta > 0, cfg.num_iterations > 1 or corrects or distills,
                           checkpoint_mode(cfg.gradient_checkpointing, device) == "always",  # auto: per device
                           teacher=distills, values=bool(cfg.value_head))
    update = passes * s.forward_s * step_completions / completions[0]
    step = rounds * (gen + reward) + update
    return {"generated_tokens": int(s.lengths.sum()), "generate_seconds": sum(s.generate_s),
            "tokens_per_second": float(s.lengths.sum()) / max(sum(s.generate_s), 1e-9),
            "generate_step_s": gen, "reward_step_s": reward, "sampling_rounds": rounds,
            "forward_pass_s": s.forward_s, "update_forward_passes": passes, "update_step_s": update,
            "update_estimate": f"{passes} forward passes, each the measured log-prob pass scaled to a step's "
                               f"{step_completions} completions",
            "step_s": step, "max_steps": cfg.max_steps, "run_s": step * cfg.max_steps}


def expected_sampling_rounds(B: int, teaching: float, max_rounds: int) -> float:
    """The expected number of rounds of dynamic sampling (trainer.sample_batch): whole rounds of B
    prompts, each group teaching with probability `teaching` independently of the others, until B
    groups taught or `max_rounds` ran. Round r runs when fewer than B groups taught in the r - 1
    before it, so E[rounds] = sum over r of P(fewer than B kept after r - 1 rounds), carried as the
    distribution of the number kept so far (below B; a round adds a Binomial(B, teaching))."""
    new = [math.comb(B, j) * teaching ** j * (1 - teaching) ** (B - j) for j in range(B + 1)]
    short = [1.0] + [0.0] * (B - 1)  # short[k]: P(k < B groups kept so far)
    rounds = 0.0
    for _ in range(max_rounds):
        rounds += sum(short)
        after = [0.0] * B
        for k, p in enumerate(short):
            for j in range(B - k):
                after[k + j] += p * new[j]
        short = after
    return rounds


def recommendations(report: dict[str, Any], temperature: float) -> list[dict[str, Any]]:
    """Advice with its reason, from the report's numbers (thresholds: the module constants); advice that
    would raise the share of groups that teach says so (`raises_teaching_share`, for `--strict`)."""
    out = []
    G, total, diff = report["num_generations"], report["total"], report["difficulty"]
    teaching = total["teaching_share"]
    grouped = report["groups_carry_the_signal"]  # PPO, distillation: flat groups teach all the same
    if grouped and teaching < LOW_TEACHING:
        better = [(int(g), 1 - z) for g, z in total["predicted_zero_variance_share"].items()
                  if int(g) > G and 1 - z >= teaching + RAISE_G_GAIN]
        n = report["samples_per_prompt"]
        if better:
            g, share = better[0]
            out.append({"advice": f"raise num_generations to {g}", "raises_teaching_share": True,
                        "reason": f"only {teaching:.0%} of groups teach at G={G}; about {share:.0%} would at "
                                  f"G={g} ({report['estimators'][str(g)]} estimate)"})
        elif n < max(GROUP_SIZES):
            out.append({"advice": f"run preflight again with --samples {max(GROUP_SIZES) // G * G or G} to see "
                                  "whether a larger num_generations would help", "raises_teaching_share": True,
                        "reason": f"only {teaching:.0%} of groups teach at G={G}, and beyond {n} samples per "
                                  "prompt the predictions are plug-in estimates, which cannot show a gain"})
    if grouped and (diff["too_easy"] >= SKEWED_PROMPTS or diff["too_hard"] >= SKEWED_PROMPTS):
        out.append({"advice": "filter the prompts (drop those always or never solved, or pick harder/easier data)",
                    "raises_teaching_share": True,
                    "reason": f"{diff['too_easy']:.0%} of prompts are always passed and {diff['too_hard']:.0%} "
                              f"never (reward {diff['reward']}, {report['samples_per_prompt']} samples each): "
                              "their groups teach nothing"})
    settled = diff["too_easy"] + diff["too_hard"]
    if settled >= 2 * SKEWED_PROMPTS:
        if temperature < 1.0:
            out.append({"advice": f"raise temperature from {temperature:g} towards 1.0", "raises_teaching_share": True,
                        "reason": f"{settled:.0%} of prompts are always or never passed: more diverse samples "
                                  "give more groups with both passes and failures"})
        elif temperature > 1.0 and diff["too_hard"] > diff["too_easy"]:
            out.append({"advice": f"lower temperature from {temperature:g} towards 1.0", "raises_teaching_share": True,
                        "reason": f"{diff['too_hard']:.0%} of prompts are never solved: sampling far from "
                                  "the policy's own distribution may be what fails them"})
    lengths = report["lengths"]
    if lengths["truncation_rate"] > MAX_TRUNCATION:
        out.append({"advice": f"raise max_completion_length above {lengths['max_completion_length']} "
                              f"(e.g. {2 * lengths['max_completion_length']})",
                    "reason": f"{lengths['truncation_rate']:.0%} of completions were cut before their end "
                              f"(more than {MAX_TRUNCATION:.0%}): their rewards judge unfinished answers"})
    for c in report["correlations"]:
        if c["r"] is not None and c["r"] < OPPOSED:
            out.append({"advice": f"check the weights of {c['a']} and {c['b']}",
                        "reason": f"within groups they correlate at r = {c['r']:.2f}: what one rewards, "
                                  "the other penalises, and their advantages partly cancel"})
    return out


def strict_failure(report: dict[str, Any], strict: float) -> str | None:
    """Why `--strict SHARE` fails the report: fewer than SHARE of groups teach (None when enough do, or
    when flat groups teach too: PPO, distillation). The recommendations judge the share by their own
    threshold (LOW_TEACHING), not by SHARE, so a share between the two gets none (and other advice, on
    lengths or weights, raises no share): the message then says what raises it, with the report's
    predictions for a larger G, rather than point at advice not given."""
    G, total, diff = report["num_generations"], report["total"], report["difficulty"]
    teaching = total["teaching_share"]
    if teaching >= strict or not report["groups_carry_the_signal"]:
        return None
    head = f"only {teaching:.1%} of groups would teach (rewards not all equal at G={G}), below --strict {strict:g}"
    if raising := [r["advice"] for r in report["recommendations"] if r.get("raises_teaching_share")]:
        return f"{head}: follow the recommendations above that raise it ({'; '.join(raising)}), or lower the threshold"
    larger = {g: 1 - z for g, z in total["predicted_zero_variance_share"].items() if int(g) > G}
    plug_in = [g for g in larger if report["estimators"][g] == "plug-in"]
    levers: list[str] = []
    if larger:
        shares = ", ".join(f"{t:.0%} at G={g}" for g, t in larger.items())
        under = f"; at G={', '.join(plug_in)} plug-in estimates, which understate it" if plug_in else ""
        levers.append(f"a larger num_generations (predicted: {shares}{under})")
    levers.append(f"prompts the policy solves only sometimes, by a prompt filter or other data "
                  f"({diff['too_easy']:.0%} are always solved, {diff['too_hard']:.0%} never)")
    return (f"{head}, and nothing recommended above raises it (its advice starts below {LOW_TEACHING:.0%} of groups "
            f"teaching, or at {SKEWED_PROMPTS:.0%} of prompts always solved or {SKEWED_PROMPTS:.0%} never). "
            f"What raises the share: {'; '.join(levers)}; or lower --strict to a share this task reaches")


# ---------------------------------------------------------------------- running and writing
def run(trainer: PreflightStages, num_prompts: int = 64, samples_per_prompt: int | None = None) -> dict[str, Any]:
    """Sample, summarise, and (rank 0) write preflight.json and preflight.png into output_dir;
    returns the report (the same on every rank)."""
    report = summarize(sample(trainer, num_prompts, samples_per_prompt), trainer.cfg, trainer.dist.device)
    if trainer.dist.is_main:
        out = Path(trainer.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".preflight.json.tmp"
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(out / "preflight.json")  # a reader never sees half a report
        plot(report, out / "preflight.png")
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """preflight.png: predicted zero-variance share by G, prompts by passes, correlations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    series = {**{k: v["predicted_zero_variance_share"] for k, v in report["rewards"].items()},
              "total (weighted)": report["total"]["predicted_zero_variance_share"]}
    for name, shares in series.items():
        ax.plot([int(g) for g in shares], list(shares.values()), marker="o", markersize=3, label=name,
                linewidth=2.5 if name.startswith("total") else 1.2)
    ax.axvline(report["num_generations"], color="gray", linestyle=":", label="config's G")
    sizes = [int(g) for g in report["estimators"]]
    if max(sizes) > report["samples_per_prompt"]:  # where only the plug-in estimate exists (module docstring)
        ax.axvspan(report["samples_per_prompt"], max(sizes), color="gray", alpha=0.12, label="plug-in (G > samples)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(g) for g in sizes])
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("zero-variance groups (predicted)")
    ax.set_xlabel("G (completions per prompt)")
    ax.legend(fontsize=8)
    ax = axes[1]
    diff, n = report["difficulty"], report["samples_per_prompt"]
    ax.bar(range(n + 1), diff["pass_count_histogram"], color=["tab:red"] + ["tab:blue"] * (n - 1) + ["tab:green"])
    ax.set_title(f"prompts by passes of {diff['reward']}: too hard {diff['too_hard']:.0%}, "
                 f"too easy {diff['too_easy']:.0%}", fontsize=9)
    ax.set_xlabel(f"passes out of {n} samples")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax = axes[2]
    names = list(report["rewards"])
    if len(names) > 1:
        r = {(c["a"], c["b"]): c["r"] for c in report["correlations"]}
        m = [[1.0 if a == b else r.get((a, b), r.get((b, a))) for b in names] for a in names]
        ax.imshow([[math.nan if v is None else v for v in row] for row in m], cmap="coolwarm", vmin=-1, vmax=1)
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                ax.text(j, i, "n/a" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
    else:
        ax.text(0.5, 0.5, "one reward function: no correlations", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.set_title("within-group correlation of rewards")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(report: dict[str, Any]) -> str:
    """The report as text for the terminal."""
    G, sizes = report["num_generations"], list(report["estimators"])
    width = max(len(n) for n in [*report["rewards"], "total (weighted)"])
    head = f"{'reward':<{width}}  {'mean':>7}  {'pass':>6}  {'zero-var@G=' + str(G):>13}  " + "  ".join(
        f"{'G=' + g:>6}" for g in sizes)
    lines = [f"preflight: {report['num_prompts']} prompts x {report['samples_per_prompt']} completions "
             f"(pass: {report['pass_definition']})", "", "predicted zero-variance share by G: "
             + ", ".join(f"G={g} {e}" for g, e in report["estimators"].items())
             + ("; plug-in overestimates it (--samples M, a multiple of G, predicts up to M unbiased)"
                if "plug-in" in report["estimators"].values() else ""), head]
    rows = [(n, v["mean"], f"{v['pass_rate']:.1%}", v) for n, v in report["rewards"].items()]
    rows.append(("total (weighted)", report["total"]["mean"], "", report["total"]))
    for name, mean, passed, v in rows:
        lines.append(f"{name:<{width}}  {'n/a' if mean is None else f'{mean:.3f}':>7}  {passed:>6}  "
                     f"{v['zero_variance_share']:>13.1%}  "
                     + "  ".join(f"{v['predicted_zero_variance_share'][g]:>6.1%}" for g in sizes))
    diff, lengths, t = report["difficulty"], report["lengths"], report["timing"]
    lines += ["", f"groups that teach at G={G}: {report['total']['teaching_share']:.1%}"
              + ("" if report["groups_carry_the_signal"] else " (for information: the value head or the "
                 "teacher gives every completion a signal, flat groups included)"),
              f"prompts ({diff['reward']}): too easy {diff['too_easy']:.1%}, too hard {diff['too_hard']:.1%}, "
              f"informative {diff['informative']:.1%}"]
    lines += [f"correlation {c['a']} ~ {c['b']}: " + ("n/a" if c["r"] is None else f"{c['r']:+.2f}")
              for c in report["correlations"]]
    lines += [f"completion length: mean {lengths['mean']:.1f}, p50 {lengths['p50']:.0f}, p90 {lengths['p90']:.0f}, "
              f"max {lengths['max']} of {lengths['max_completion_length']}; truncated {lengths['truncation_rate']:.1%}",
              f"generation: {t['tokens_per_second']:.0f} tokens/s; per step ~ {t['step_s']:.3g} s (generate "
              f"{t['generate_step_s']:.3g} s x {t['sampling_rounds']:.2g} round(s) + rewards "
              f"{t['reward_step_s']:.3g} s + update ~{t['update_step_s']:.3g} s, estimated as {t['update_estimate']}); "
              f"{t['max_steps']} steps ~ {t['run_s'] / 60:.3g} min", "",
              "recommendations:" if report["recommendations"] else "recommendations: none"]
    lines += [f"  - {r['advice']}: {r['reason']}" for r in report["recommendations"]]
    return "\n".join(lines)


def _shares(predicted: dict[int, tuple[float, str]]) -> dict[str, float]:
    return {str(g): share for g, (share, _) in predicted.items()}


def _finite(x: torch.Tensor) -> float | None:
    """A float for JSON: None for NaN (every score abstained), which JSON cannot hold."""
    v = float(x)
    return v if math.isfinite(v) else None
