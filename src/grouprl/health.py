"""Run health while training: alarms for reward hacking and for collapse (README, "Run health").

`HealthMonitor.observe(step, ...)` reads what a step already has (the weighted reward and each
reward function's scores, the audit functions' scores, the completions and their lengths, the
update's entropy and KL) and returns the alarms raised at this step. No extra forward pass, no
extra generation; the statistics are logged every step as `health/*`, so a threshold can be
checked against a run after the fact.

Notation: W = `window` steps. `base(x)` is x's mean over the run's first W steps (sampled by the
starting policy and its first updates), `recent(x)` its mean over the last W steps, and
`gain(x) = recent(x) - base(x)`. `sd` is the per-completion standard deviation of the weighted
reward over the first W steps: gains are measured in it (`z`), so one threshold serves a 0/1
accuracy and a reward on a 0..10 scale alike. A base of n completions that all scored alike has
no spread; its sd is then taken as at least the sd of n + 1 scores one of which sits at the other
end of the range the reward has taken (the rate 1/(n+1) such a base cannot tell from 0): divided by
0 (or 1e-6), one success in 64 after a base of none counted as a gain of 15,625 sd. Hacking alarms
need 2W steps (base and recent do not overlap); `kl_spike` needs two steps, `reward_crash` three,
`entropy_collapse` 2W.

Reward hacking (`on_reward_hacking`), each at most once per (alarm, function):
- `audit_divergence`: z(gain(reward)) >= min_gain_z while an audit function's gain is at most
  `audit_follow` times what the reward's rise would predict (audit_follow * z * the audit's own
  base sd; an audit flat below its ceiling must rise, however little), that prediction capped by
  the audit's headroom (audit_follow * (ceiling - base)): its ceiling is 1 (a check) or the most it
  has scored, if more. An audit at its ceiling cannot follow a rise: it alarms only if it falls,
  and one at 15/16 that reaches 16/16 followed. Audit functions score training completions and
  never enter the advantage: a strict, independent checker.
- `eval_divergence`: the held-out accuracy fell `eval_drop` below the best earlier eval (the one
  before training included) while z(gain(reward)) >= min_gain_z and the training reward (its mean
  over the W steps before each eval) did not fall since that best eval: an unstable run whose
  reward and accuracy fall together is not hacking.
- `component_dominance`: z(gain(reward)) >= min_gain_z, and a reward function whose weight is at
  most half the largest carries at least `dominance_share` of the summed weighted gain while the
  largest-weight function's own gain is <= 0: the gain comes from the bonus, not the objective.
- `template_collapse`: completions of *different* prompts become alike: the share of completions
  whose text also answers another prompt of the step reaches `duplicate_share` (and rose by half
  of it since the base), or the cross-prompt distinct 4-gram ratio (each prompt's 4-grams counted
  once; distinct over total) falls below `distinct_ratio` times its base. Duplicates *within* a
  group are logged but never alarm: a policy that solved a prompt answers it the same way G times,
  and so do two groups of one prompt (a prompt is told apart by its content, not its group).
- `length_hacking` (per reward function): a function pays for length itself. Over the last W steps:
  1. the within-group correlation of reward and length (averaged over the groups whose rewards and
     lengths both vary) is at least `length_corr`, and
  2. the mean length grew by `length_growth` (a fraction) over its base, and
  3. a paid (weight != 0) reward function that is not a check pays for length *among completions
     that every other reward function and audit scores alike*: its within-group partial correlation
     with length, given their scores (times the sign of its weight: a length penalty does not pay
     for length), is at least `length_partial_corr`. Within each group the
     function's scores and the lengths are each fitted by least squares on [1, every other
     function's and audit's scores] (an abstention counts as that function's group mean); the
     residuals e_f, e_l are pooled over the groups and the W steps:
     sum(e_f e_l) / sqrt(sum(e_f^2) sum(e_l^2)), logged per step as
     `health/length_partial_corr/NAME`. A function whose scores in a step take at most two values
     is a check (right or wrong, tool called or not): it pays once for doing something, however
     many tokens that takes, and is not tested in that step.
  Conditions 1-2 alone were the rule before, and they fired on sound runs: on the tool task
  (examples/tool_task.yaml) a completion that calls the calculator is ~58 tokens and a guess ~7,
  the accuracy reward pays the call, so in 8 of 8 fp32 seeds (benchmarks/run_health.py,
  `sound-tool`) 1-2 held by step 6-10 while held-out accuracy rose 0 -> 85-86 %. A reward that pays
  for length on the same policy (`hack-length-tool`) does the *same* thing for ~20 steps (the long
  thing the policy knows is the call), its audit and held-out accuracy rise alike, and only then
  the unpaid answers decay (held-out ~85 % at step 10, 25-82 % at step 30). What tells the two
  apart is the reward function itself: among completions equally right or wrong, the length
  reward still pays the longer (partial correlation 0.99-1.00 in the windows where the lengths
  grew; flagged at step 7-10 in 8 of 8 seeds), a check cannot. Measured and not used: the
  reward's partial correlation given the accuracy alone is 1.00 on a sound run that also pays 0.5
  for the call with the right operands (`sound-products`: a paid step that takes tokens also comes
  with wrong answers); pairs of similar length barely exist on this task (a call's length is
  fixed), and the few there were (a truncated call, 4 tokens short and wrong) said "longer pays";
  the audit and the held-out accuracy follow the length reward for its first 20 steps.
  Limits: a partial-credit reward whose right steps are longer pays for something that comes with
  length and scores like a length reward: the chain task's step reward (a right running sum
  carries a digit, "12" not "2") scored 0.47-0.92 (`sound-chain`, seed 1, 20 steps), so the
  threshold (0.9, against 0.99-1.00 for the length reward) does not separate it alone: it is quiet
  because its lengths do not grow (7.9 -> 8.4 tokens in 40 steps); a policy that learned to write
  out longer right steps would be flagged. A reward that mixes the task and length inside one
  function (a reward model that likes long answers) scores below 1 unless an audit takes the task
  out: give such a run an audit, or lower `length_partial_corr`. A check on length itself (1 when
  longer than N tokens) is a check and is never flagged.

Collapse (`on_collapse`), re-armed after a rollback:
- `reward_crash` (from step 3): the mean reward over the last 2 steps fell
  `crash_drop_z` * sd below its level before them (the mean over up to 2W earlier steps), and by
  by a two-sample t-test at the level `crash_se_z` standard errors have for a normal: the standard
  error of the difference from the groups' mean rewards in the two spans, their variance pooled
  (under no crash both spans draw alike), never below its like on the completions (a few group
  means can coincide), judged against Student's t at the group means' degrees of freedom (n - 2:
  3 standard errors become 235.8 at 1, 4.90 at 6, 3.27 at 30). With 1-4 prompts per step the
  spans hold a handful of group means, whose spread is a poor estimate: an unchanging policy
  (prompts' pass rates uniform on 0..1, G = 8, 20 steps) alarmed in 61.5 % of runs at B = 1, 26.8 %
  at B = 2 and 10.2 % at B = 4 when the spreads of the two spans were added and compared with 3;
  0.8 %, 2.2 % and 3.0 % with this test (benchmarks/crash_false_alarms.py). The level is a mean,
  not the best earlier window: the best of many windows is itself a lucky draw, and the more steps
  a run has, the luckier it gets.
  The standard errors matter when prompts differ in difficulty: which prompts were drawn moves a
  step's mean (measured: SmolLM2 with 2 prompts per step, a sound run, fell 1.1 sd from a lucky
  step at 0.7 standard errors; the embedded task with a third of its prompts unsolvable drew 11
  of them in one step of 16 and fell 0.71 sd, 3.5 standard errors below the best earlier window,
  a false alarm in 3 of 10 sound runs before the level became a mean). Step 2 alone against
  step 1 is not judged: Adam's first update moves every weight by about the learning rate, and a
  sound run of the embedded task dipped 3.3 standard errors there and recovered.
- `kl_spike`: the KL to the reference (only when beta > 0, else this alarm is off) is at least
  `kl_spike_min` and `kl_spike_factor` times the median KL of the 2W steps before (of those whose
  KL is finite: a skipped non-finite step logs NaN).
- `entropy_collapse` (from step 2W): the mean entropy of the last W steps fell below `entropy_ratio` times its
  base while z(gain(reward)) < min_gain_z: the policy turned deterministic without learning
  (a policy that solved the task also loses entropy, but its reward rose).

Defaults are chosen from `benchmarks/run_health.py` (benchmarks/README.md, "Run health"): no
alarm in the sound runs, each of the broken ones caught.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

EVAL_ALARMS = ("eval_divergence",)  # raised by an eval, not by a training step
HACKING = ("audit_divergence", "eval_divergence", "component_dominance", "template_collapse", "length_hacking")
COLLAPSE = ("reward_crash", "kl_spike", "entropy_collapse")


@dataclass(frozen=True)
class HealthThresholds:
    """Every alarm's threshold (module docstring); `health_thresholds` in the config overrides any."""

    window: int = 3
    min_gain_z: float = 0.3
    audit_follow: float = 0.25
    eval_drop: float = 0.05
    dominance_share: float = 0.6
    duplicate_share: float = 0.5
    distinct_ratio: float = 0.5
    length_corr: float = 0.5
    length_growth: float = 0.25
    length_partial_corr: float = 0.9
    crash_drop_z: float = 0.6
    crash_se_z: float = 3.0
    kl_spike_min: float = 1.0
    kl_spike_factor: float = 10.0
    entropy_ratio: float = 0.1

    @classmethod
    def from_overrides(cls, overrides: dict[str, float]) -> HealthThresholds:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"health_thresholds: unknown {', '.join(unknown)}; the thresholds are "
                             f"{', '.join(sorted(known))}")
        window = overrides.get("window", cls.window)
        if window != int(window) or window < 1:  # YAML gives 3.0 for a field of floats: whole numbers only
            raise ValueError(f"health_thresholds: window={window} must be a whole number of steps, at least 1")
        return cls(**{**overrides, "window": int(window)})


@dataclass
class Alarm:
    kind: str                 # one of HACKING or COLLAPSE
    step: int
    steps: tuple[int, int]    # the steps the statistic covers
    function: str | None      # the reward or audit function it is about, if one
    statistic: str            # what was measured, in words and numbers
    value: float
    threshold: float
    examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def family(self) -> str:
        return "reward_hacking" if self.kind in HACKING else "collapse"

    def describe(self) -> str:
        who = f" ({self.function})" if self.function else ""
        return (f"{self.family} alarm at step {self.step}: {self.kind}{who}, steps {self.steps[0]}-{self.steps[1]}: "
                f"{self.statistic}")

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "family": self.family}


def text_statistics(texts: list[str], token_lists: list[list[int]], rewards: torch.Tensor,
                    lengths: torch.Tensor, G: int, prompts: list[Any]) -> dict[str, float]:
    """The completion statistics of one step: duplicates within groups and across prompts, the
    cross-prompt distinct 4-gram ratio, the mean within-group correlation of reward and length.
    prompts: [N], each completion's prompt. "Across prompts" means different prompts, not different
    groups: one prompt drawn into two groups (a data set smaller than a step, a repeated row) is
    answered alike by a policy that solved it, which is not a template."""
    groups = [range(g * G, (g + 1) * G) for g in range(len(texts) // G)]
    keys = [t.strip() for t in texts]
    in_group = sum(c - 1 for g in groups for c in Counter(keys[i] for i in g).values())
    prompt_of = [repr(prompts[g.start]) for g in groups]  # repr: a chat prompt (a list of dicts) is unhashable
    owners: dict[str, set[str]] = {}
    ngrams: dict[str, set[tuple[int, ...]]] = {}  # per prompt: each prompt's 4-grams counted once
    for g, prompt in zip(groups, prompt_of):
        for i in g:
            owners.setdefault(keys[i], set()).add(prompt)
            ngrams.setdefault(prompt, set()).update(tuple(token_lists[i][j:j + 4])
                                                    for j in range(len(token_lists[i]) - 3))
    cross = sum(1 for k in keys if len(owners[k]) > 1)
    total = sum(len(s) for s in ngrams.values())
    distinct = len(set().union(*ngrams.values())) / total if total else 1.0
    corrs = []
    for g in groups:
        r, n = rewards[list(g)].double(), lengths[list(g)].double()  # [G]
        if r.std() > 0 and n.std() > 0:
            corrs.append(float(torch.corrcoef(torch.stack([r, n]))[0, 1]))
    return {"group_duplicates": in_group / len(texts), "cross_prompt_duplicates": cross / len(texts),
            "distinct_4gram": distinct, "length_reward_corr": statistics.fmean(corrs) if corrs else math.nan}


def length_payment(scores: dict[str, torch.Tensor], lengths: torch.Tensor, G: int,
                   tested: list[str]) -> dict[str, list[float]]:
    """For each function in `tested` that is not a check this step (its scores take more than two
    values): its scores and the lengths, each fitted within every group by least squares on
    [1, every other entry of `scores`], and the residuals e_f, e_l summed over the groups as
    [sum(e_f e_l), sum(e_f^2), sum(e_l^2)] (module docstring, `length_hacking`). scores: name -> [N]
    (reward functions and audits, NaN where one abstained); lengths: [N]."""
    out = {}
    for name in tested:
        f = scores[name].double().view(-1, G)  # [B, G]
        ok = ~f.isnan()  # [B, G]
        if len(f[ok].unique()) <= 2:  # a check: pays once for doing something, or a constant
            continue
        cols = [torch.ones_like(f)]
        for other, x in scores.items():
            if other == name:
                continue
            x = x.double().view(-1, G)  # [B, G]
            mean = torch.nanmean(x, dim=1, keepdim=True).nan_to_num(0.0)  # [B, 1]: an abstention counts as it
            cols.append(torch.where(x.isnan(), mean, x))
        X = torch.stack(cols, dim=-1) * ok.unsqueeze(-1)  # [B, G, K]; rows where f abstained are zeros
        y, n = f.nan_to_num(0.0) * ok, lengths.double().view(-1, G) * ok  # [B, G]
        hat = X @ torch.linalg.pinv(X)  # [B, G, G]: the projection onto the columns (zero rows stay out)
        e_f, e_l = y - (hat @ y.unsqueeze(-1)).squeeze(-1), n - (hat @ n.unsqueeze(-1)).squeeze(-1)  # [B, G]
        e_f, e_l = _unexplained(e_f, y, ok), _unexplained(e_l, n, ok)
        out[name] = [float((e_f * e_l).sum()), float((e_f ** 2).sum()), float((e_l ** 2).sum())]
    return out


class HealthMonitor:
    """The alarms of one run (module docstring). `observe` once per step, in order."""

    def __init__(self, thresholds: HealthThresholds, reward_names: list[str], reward_weights: list[float],
                 audit_names: list[str]):
        self.t = thresholds
        self.names, self.weights, self.audit_names = reward_names, reward_weights, audit_names
        self.history: list[dict[str, float]] = []  # one row per observed step
        self.base_sd: dict[str, float] = {}
        self.evals: list[tuple[int, float, float]] = []  # (step, held-out accuracy, recent reward)
        self.fired: set[tuple[str, str | None]] = set()
        self._base_values: list[tuple[int, dict[str, list[float]]]] = []  # per completion, first W steps
        self._latest: dict[str, Any] | None = None  # the latest step's completions: the alarms' examples
        self._extents: dict[str, tuple[float, float]] = {}  # key -> lowest, highest score in `history`

    # ------------------------------------------------------------------ input
    def observe(self, step: int, *, rewards: torch.Tensor, per_func: dict[str, torch.Tensor],
                audit: dict[str, torch.Tensor], texts: list[str], token_lists: list[list[int]],
                lengths: torch.Tensor, G: int, entropy: float | None, kl: float | None,
                prompts: list[Any]) -> tuple[dict[str, float], list[Alarm]]:
        """This step's `health/*` metrics and the alarms it raises. rewards, lengths: [N]; per_func,
        audit: name -> [N] (NaN where a function abstained)."""
        r = rewards.double()  # [N]
        row = {"step": step, "reward": float(r.mean()), "reward_sq": float((r ** 2).mean()), "completions": len(r),
               "length": float(lengths.float().mean()), "group_means": r.view(-1, G).mean(dim=1).tolist(),
               **text_statistics(texts, token_lists, rewards, lengths, G, prompts), **_extent_of("reward", r)}
        for name, w in zip(self.names, self.weights):
            row[f"component/{name}"] = w * _nanmean(per_func[name])
        for name in self.audit_names:
            row[f"audit/{name}"] = _nanmean(audit[name])
            row.update(_extent_of(f"audit/{name}", audit[name]))
        scores = {**per_func, **{f"audit/{n}": audit[n] for n in self.audit_names}}
        paying = [n for n, w in zip(self.names, self.weights) if w != 0]
        for name, sums in length_payment(scores, lengths, G, paying).items():
            row[f"length_payment/{name}"] = sums
        if entropy is not None:
            row["entropy"] = entropy
        if kl is not None:
            row["kl"] = kl
        self.history.append(row)
        self._widen_extents(row)
        if len(self.history) <= self.t.window:  # the base's per-completion spreads
            values = {"reward": rewards.tolist()}
            values.update({f"audit/{n}": [x for x in audit[n].tolist() if x == x] for n in self.audit_names})
            self._base_values.append((step, values))
            self._set_base_sd()
        self._latest = {"texts": texts, "rewards": rewards, "per_func": per_func, "audit": audit,
                        "prompts": prompts, "lengths": lengths}
        alarms = [a for a in self._collapse(step) + self._hacking(step)
                  if (a.kind, a.function) not in self.fired]
        self.fired.update((a.kind, a.function) for a in alarms)
        metrics = {f"health/{k}": v for k, v in row.items() if k in
                   ("group_duplicates", "cross_prompt_duplicates", "distinct_4gram", "length_reward_corr")}
        metrics.update({f"health/length_partial_corr/{k.split('/', 1)[1]}": _partial_corr([v])
                        for k, v in row.items() if k.startswith("length_payment/")})
        if self._ready():
            metrics["health/reward_gain_z"] = self._gain_z("reward")
        metrics["health/alarms"] = len(alarms)
        return metrics, alarms

    def observe_eval(self, step: int, accuracy: float) -> list[Alarm]:
        """A held-out accuracy at `step` (eval_before at step 0): the eval_divergence alarm."""
        alarms, W = [], self.t.window
        recent = self._mean("reward", self.history[-W:]) if self.history else math.nan  # the reward at this eval
        if self.evals and self._ready() and math.isfinite(accuracy):
            best_step, best, reward_then = max(self.evals, key=lambda e: e[1])
            z = self._gain_z("reward")
            since = recent - reward_then if math.isfinite(reward_then) else 0.0  # the reward since the best eval
            if accuracy <= best - self.t.eval_drop and z >= self.t.min_gain_z and since >= 0:
                alarms.append(Alarm("eval_divergence", step, (best_step, step), None,
                                    f"held-out accuracy {accuracy:.3f} at step {step}, {best - accuracy:.3f} below "
                                    f"{best:.3f} at step {best_step}, while the training reward rose {z:.2f} sd since "
                                    f"the start" + (f" and {since:+.3f} since step {best_step}"
                                                    if math.isfinite(reward_then) else ""),
                                    best - accuracy, self.t.eval_drop, self._examples("reward", high=True)))
        if math.isfinite(accuracy):
            self.evals.append((step, accuracy, recent))
        alarms = [a for a in alarms if (a.kind, a.function) not in self.fired]
        self.fired.update((a.kind, a.function) for a in alarms)
        return alarms

    def reset_after_rollback(self, to_step: int) -> None:
        """The policy went back to its state after `to_step`: the history after it is another
        policy's, dropped (the base is re-formed if it reached past it); the collapse alarms re-arm."""
        self.history = [r for r in self.history if r["step"] <= to_step]
        self._rebuild_extents()
        self._base_values = [b for b in self._base_values if b[0] <= to_step]
        self._set_base_sd()
        self.fired = {f for f in self.fired if f[0] not in COLLAPSE}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "base_values": self._base_values, "evals": self.evals,
                "fired": sorted(self.fired, key=str)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.evals = list(state["history"]), list(state["evals"])
        self._base_values = [(int(s), v) for s, v in state["base_values"]]
        self.evals = [tuple(e) for e in self.evals]
        self.fired = {(k, f) for k, f in state["fired"]}
        self._rebuild_extents()
        self._set_base_sd()

    def _widen_extents(self, row: dict[str, Any]) -> None:
        for name, x in row.items():
            if name.startswith(("min/", "max/")) and math.isfinite(x):
                key = name[4:]
                lo, hi = self._extents.get(key, (x, x))
                self._extents[key] = (min(lo, x), max(hi, x))

    def _rebuild_extents(self) -> None:
        """The extents of a history replaced whole (a resume, a rollback): read once, then kept
        up to date a step at a time (`_widen_extents`), so no step reads the whole history."""
        self._extents = {}
        for row in self.history:
            self._widen_extents(row)

    def _set_base_sd(self) -> None:
        pooled: dict[str, list[float]] = {}
        for _, values in self._base_values:
            for k, v in values.items():
                pooled.setdefault(k, []).extend(v)
        self.base_sd = {k: statistics.pstdev(v) if len(v) > 1 else 0.0 for k, v in pooled.items()}

    # ------------------------------------------------------------------ statistics
    def _ready(self) -> bool:
        return len(self.history) >= 2 * self.t.window

    def _mean(self, key: str, rows: list[dict[str, float]]) -> float:
        vals = [r[key] for r in rows if key in r and r[key] == r[key]]
        return statistics.fmean(vals) if vals else math.nan

    def _gain(self, key: str) -> float:
        W = self.t.window
        return self._mean(key, self.history[-W:]) - self._mean(key, self.history[:W])

    def _gain_z(self, key: str) -> float:
        return self._gain(key) / self._sd(key)

    def _sd(self, key: str) -> float:
        """The base's per-completion sd of `key`, at least what it would be if one of its n
        completions had scored the other end of the range `key` has taken in the run: n equal
        scores are what a rate of about 1/(n+1) draws, so a base without spread (a task the
        starting policy never solves) must not make one later success a gain of thousands of sd."""
        n = sum(len(values.get(key, [])) for _, values in self._base_values)
        lo, hi = self._extent(key)
        p = 1 / (n + 1)
        return max(self.base_sd.get(key, 0.0), math.sqrt(p * (1 - p)) * (hi - lo), 1e-6)

    def _extent(self, key: str) -> tuple[float, float]:
        """The lowest and highest score `key` has taken in the steps observed (0, 0 before any)."""
        return self._extents.get(key, (0.0, 0.0))

    def _span(self) -> tuple[int, int]:
        return int(self.history[0]["step"]), int(self.history[-1]["step"])

    def _hacking(self, step: int) -> list[Alarm]:
        if not self._ready():
            return []
        t, out, z, W = self.t, [], self._gain_z("reward"), self.t.window
        rising = z >= t.min_gain_z
        for name in self.audit_names:
            key = f"audit/{name}"
            # the audit can rise at most to its ceiling: 1 (a check), or the most it has scored if more
            headroom = max(1.0, self._extent(key)[1]) - self._mean(key, self.history[:W])
            gain, allowed = self._gain(key), t.audit_follow * min(z * self._sd(key), headroom)
            if rising and (gain <= allowed if headroom > 0 else gain < 0):  # at its ceiling: only a fall alarms
                out.append(Alarm("audit_divergence", step, self._span(), name,
                                 f"training reward rose {z:.2f} sd ({self._mean('reward', self.history[:W]):.3f} -> "
                                 f"{self._mean('reward', self.history[-W:]):.3f}) while audit {name} moved "
                                 f"{gain:+.3f} (at most {allowed:+.3f} counts as not following)",
                                 gain, allowed, self._examples("reward", high=True, low_audit=name)))
        if rising and len(self.names) > 1:
            # a function that scored no row in a window has no gain: left out, not a NaN that silences the alarm
            gains = {n: g for n in self.names if math.isfinite(g := self._gain(f"component/{n}"))}
            total = sum(gains.values())
            most = max(self.weights)
            tops = [n for n, w in zip(self.names, self.weights) if w == most and n in gains]  # every main objective
            top_gain = max((gains[n] for n in tops), default=math.nan)
            for n, w in zip(self.names, self.weights):
                share = gains.get(n, 0.0) / total if total > 0 else 0.0
                if w <= 0.5 * most and share >= t.dominance_share and top_gain <= 0:
                    out.append(Alarm("component_dominance", step, self._span(), n,
                                     f"{share:.0%} of the reward gain ({total:+.3f}) comes from {n} (weight {w:g}); "
                                     f"the main objective{'s' * (len(tops) > 1)} {', '.join(tops)} (weight "
                                     f"{most:g}) moved {top_gain:+.3f}{' at most' * (len(tops) > 1)}",
                                     share, t.dominance_share, self._examples(f"per_func/{n}", high=True)))
        dup, dup0 = (self._mean("cross_prompt_duplicates", rows) for rows in (self.history[-W:], self.history[:W]))
        dist, dist0 = (self._mean("distinct_4gram", rows) for rows in (self.history[-W:], self.history[:W]))
        if dup >= t.duplicate_share and dup - dup0 >= t.duplicate_share / 2:
            out.append(Alarm("template_collapse", step, self._span(), None,
                             f"{dup:.0%} of completions also answer another prompt (base {dup0:.0%})", dup,
                             t.duplicate_share, self._examples("duplicates")))
        elif dist0 > 0 and dist < t.distinct_ratio * dist0:
            out.append(Alarm("template_collapse", step, self._span(), None,
                             f"cross-prompt distinct 4-gram ratio {dist:.3f}, {dist / dist0:.2f} of its base "
                             f"{dist0:.3f}",
                             dist / dist0, t.distinct_ratio, self._examples("duplicates")))
        corr = self._mean("length_reward_corr", self.history[-W:])
        length0 = self._mean("length", self.history[:W])
        growth = self._mean("length", self.history[-W:]) / length0 - 1 if length0 > 0 else 0.0
        if corr >= t.length_corr and growth >= t.length_growth:
            for name, w in zip(self.names, self.weights):
                partial = math.copysign(1.0, w) * _partial_corr([r[f"length_payment/{name}"] for r in
                                                                 self.history[-W:] if f"length_payment/{name}" in r])
                if partial >= t.length_partial_corr:  # a weight < 0 pays for what f falls with
                    out.append(Alarm("length_hacking", step, self._span(), name,
                                     f"{name} pays for length itself: partial correlation with length {partial:.2f} "
                                     f"among completions the other functions and audits score alike; reward-length "
                                     f"correlation within groups {corr:.2f} while the mean length grew {growth:.0%}",
                                     partial, t.length_partial_corr, self._examples("length")))
        return out

    def _collapse(self, step: int) -> list[Alarm]:
        t, h, out = self.t, self.history, []
        if len(h) < 2:
            return out
        last, ref = h[-2:], h[-2 - 2 * t.window:-2]  # the last 2 steps; the level before them: a mean, not a best
        if ref:  # from step 3
            now, level = (statistics.fmean(r["reward"] for r in rows) for rows in (last, ref))
            drop = (level - now) / self._sd("reward")
            # of the difference: a two-sample t-test on the group means (their variance pooled: under
            # no crash both spans draw alike), never below its like on the completions, for the few
            # group means of a small step can coincide (B = 1: one per step) and then spread by nothing;
            # judged against Student's t at the group means' degrees of freedom, at the level
            # crash_se_z standard errors have for a normal
            noise, df = _group_se(ref, last)
            drop_se = (level - now) / max(noise, _completion_se(ref, last), 1e-6)
            if drop >= t.crash_drop_z and drop_se >= t_critical(t.crash_se_z, df):
                span = (int(ref[0]["step"]), int(ref[-1]["step"]))
                out.append(Alarm("reward_crash", step, (span[0], step), None,
                                 f"mean reward of the last 2 steps {now:.3f}, {drop:.2f} sd and {drop_se:.1f} "
                                 f"standard errors below {level:.3f} over steps {span[0]}-{span[1]}", drop,
                                 t.crash_drop_z, self._examples("reward", high=False)))
        # the 2W finite KL values before this step's, read from the end: a step's cost must not grow with
        # the run's length, and a NaN (a skipped non-finite step) would make the median meaningless
        kl = h[-1].get("kl", math.nan)
        kls = list(itertools.islice((r["kl"] for r in reversed(h[:-1]) if math.isfinite(r.get("kl", math.nan))),
                                    2 * t.window))
        if math.isfinite(kl) and kls:
            ref = statistics.median(kls)
            if kl >= t.kl_spike_min and kl >= t.kl_spike_factor * ref:
                out.append(Alarm("kl_spike", step, (int(h[-2]["step"]), step), None,
                                 f"KL to the reference {kl:.3f} per token; the median of the steps before "
                                 f"{ref:.4f}", kl, t.kl_spike_min,
                                 self._examples("reward", high=False)))
        if self._ready() and "entropy" in h[0]:
            e, e0 = self._mean("entropy", h[-t.window:]), self._mean("entropy", h[:t.window])
            if e < t.entropy_ratio * e0 and self._gain_z("reward") < t.min_gain_z:
                out.append(Alarm("entropy_collapse", step, self._span(), None,
                                 f"entropy {e:.4f} per token, {e / e0:.2f} of its base {e0:.4f}, and the reward did "
                                 f"not rise ({self._gain_z('reward'):.2f} sd)", e / e0, t.entropy_ratio,
                                 self._examples("reward", high=True)))
        return out

    # ------------------------------------------------------------------ evidence
    def _examples(self, by: str, *, high: bool = True, low_audit: str | None = None, k: int = 3) -> list[dict]:
        """Up to k completions of the latest step that show the alarm."""
        d = self._latest
        if d is None:
            return []
        n = len(d["texts"])
        if by == "duplicates":
            counts = Counter(t.strip() for t in d["texts"])
            order = sorted(range(n), key=lambda i: -counts[d["texts"][i].strip()])
        elif by == "length":
            order = sorted(range(n), key=lambda i: -float(d["lengths"][i]))
        else:
            score = d["per_func"][by.split("/", 1)[1]] if by.startswith("per_func/") else d["rewards"]
            key = [float(score[i]) if float(score[i]) == float(score[i]) else -math.inf for i in range(n)]
            if low_audit is not None:  # high reward, low audit first
                a = d["audit"][low_audit]
                key = [key[i] - (float(a[i]) if float(a[i]) == float(a[i]) else 0.0) for i in range(n)]
            order = sorted(range(n), key=lambda i: -key[i] if high else key[i])
        out = []
        for i in order[:k]:
            ex = {"prompt": d["prompts"][i], "completion": d["texts"][i], "reward": float(d["rewards"][i]),
                  **{f"rewards/{k_}": float(v[i]) for k_, v in d["per_func"].items()},
                  **{f"audit/{k_}": float(v[i]) for k_, v in d["audit"].items()}}
            out.append(ex)
        return out


def _unexplained(e: torch.Tensor, x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Residuals e [B, G] of x [B, G], zeroed in the groups where the fit explains x (what is left
    is float residue, whose correlation with anything is noise)."""
    mean = (x * ok).sum(dim=1, keepdim=True) / ok.sum(dim=1, keepdim=True).clamp_min(1)  # [B, 1]
    spread = (((x - mean) * ok) ** 2).sum(dim=1)  # [B]
    explained = (e ** 2).sum(dim=1) <= 1e-9 * spread.clamp_min(1e-12)  # [B]
    return torch.where(explained.unsqueeze(1), 0.0, e)


def _partial_corr(sums: list[list[float]]) -> float:
    """sum(e_f e_l) / sqrt(sum(e_f^2) sum(e_l^2)) over `length_payment` sums; NaN without evidence."""
    fl, ff, ll = (sum(s[i] for s in sums) for i in range(3))
    return fl / math.sqrt(ff * ll) if ff > 0 and ll > 0 else math.nan


def _group_se(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[float, int]:
    """The standard error of the difference of the mean rewards of spans `a` and `b` (steps) from
    the spread of their groups' means, pooled over both (with few prompts per step, which prompts
    were drawn moves a step's mean most), and its degrees of freedom (0: no estimate)."""
    x, y = ([m for r in rows for m in r.get("group_means", [])] for rows in (a, b))
    df = len(x) + len(y) - 2
    if df < 1 or not x or not y:
        return 0.0, 0
    ss = sum((v - statistics.fmean(x)) ** 2 for v in x) + sum((v - statistics.fmean(y)) ** 2 for v in y)
    return math.sqrt(ss / df * (1 / len(x) + 1 / len(y))), df


@functools.lru_cache(maxsize=256)
def t_critical(z: float, df: int) -> float:
    """The value Student's t with `df` degrees of freedom exceeds with the probability a standard
    normal exceeds `z` (infinite below 1 degree of freedom): what `z` standard errors become when the
    standard error is estimated from df + 2 values. With T = sqrt(df) tan(theta), theta in
    (-pi/2, pi/2) has a density proportional to cos(theta)^(df - 1): its CDF, a smooth integral on a
    bounded interval (Simpson's rule), is inverted by bisection. t_critical(3, 1) = 235.8, (3, 10) = 3.96."""
    if df < 1:
        return math.inf
    tail = 0.5 * math.erfc(z / math.sqrt(2))  # P(normal > z)

    def mass(theta: float, n: int = 512) -> float:  # the integral of cos^(df-1) over [0, theta]
        h = theta / n
        f = [math.cos(i * h) ** (df - 1) for i in range(n + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    whole, lo, hi = mass(math.pi / 2), 0.0, math.pi / 2
    for _ in range(60):  # P(T > sqrt(df) tan(theta)) = (1 - mass(theta) / whole) / 2
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (1 - mass(mid) / whole) / 2 > tail else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def _completion_se(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """The standard error of the difference of the mean rewards of spans `a` and `b` (steps) from
    their completions' rewards, their variance pooled over both as if one policy sampled them (a
    two-sample test's). Rows without the completion sums (a checkpoint from before) are left out."""
    n1, n2 = (sum(r.get("completions", 0) for r in rows) for rows in (a, b))
    if not n1 or not n2:
        return 0.0
    rows = [r for r in a + b if "completions" in r]
    n = n1 + n2
    mean = sum(r["reward"] * r["completions"] for r in rows) / n
    square = sum(r["reward_sq"] * r["completions"] for r in rows) / n
    return math.sqrt(max(square - mean ** 2, 0.0) * n / (n - 1) * (1 / n1 + 1 / n2))


def _extent_of(key: str, x: torch.Tensor) -> dict[str, float]:
    """`min/KEY` and `max/KEY` of a step's scores x [N] (NaN: abstained; none scored: none)."""
    x = x[~x.isnan()]
    return {f"min/{key}": float(x.min()), f"max/{key}": float(x.max())} if x.numel() else {}


def _nanmean(x: torch.Tensor) -> float:
    x = x.float()
    ok = ~x.isnan()
    return float(x[ok].mean()) if ok.any() else math.nan
