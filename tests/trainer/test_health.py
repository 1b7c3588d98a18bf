"""Run health (health.py): each alarm's statistic on hand-built streams, where it must fire and where it
must not; then through the trainer: a gameable reward flagged with its examples (and `stop` ending the
run with a checkpoint), a learning rate far too high caught and rolled back, audit functions logged."""

import functools
import json
import math
import pickle

import pytest
import torch

from grouprl import health
from grouprl.config import ConfigError, TrainConfig
from grouprl.guard import RunGuard
from grouprl.health import HealthMonitor, HealthThresholds, text_statistics
from grouprl.signals import HEALTH_EXIT_CODE, TrainingStopped
from grouprl.trainer import Trainer
from tests.trainer.conftest import digit_fraction, read_metrics

G = 4


def _step(mon: HealthMonitor, step: int, *, p_main: float = 0.5, p_bonus: float = 0.0,
          audit: float | list[float] | None = None,
          entropy: float | None = 1.0, kl: float | None = None, texts: list[str] | None = None,
          lengths: list[int] | None = None, rewards: list[float] | None = None):
    """One observed step of 4 groups x G: the main reward is 1 for a fraction p_main of each group's
    completions, the bonus likewise; the reward is main + 0.2 * bonus."""
    n = 4 * G
    main = torch.tensor([1.0 if (i % G) < round(p_main * G) else 0.0 for i in range(n)])
    bonus = torch.tensor([1.0 if (i % G) < round(p_bonus * G) else 0.0 for i in range(n)])
    r = torch.tensor(rewards) if rewards is not None else main + 0.2 * bonus
    texts = texts or [f"answer {i} {step}" for i in range(n)]
    lengths = torch.tensor(lengths or [10] * n)
    au = {} if audit is None else {"strict": torch.tensor(audit) if isinstance(audit, list) else
                                   torch.full((n,), float(audit))}
    return mon.observe(step, rewards=r, per_func={"main": main, "bonus": bonus}, audit=au, texts=texts,
                       token_lists=[[ord(c) for c in t] for t in texts], lengths=lengths, G=G, entropy=entropy,
                       kl=kl, prompts=[f"p{i // G}" for i in range(n)])


def _monitor(audit: bool = False, **overrides) -> HealthMonitor:
    return HealthMonitor(HealthThresholds(**overrides), ["main", "bonus"], [1.0, 0.2], ["strict"] if audit else [])


def _observe(mon: HealthMonitor, step: int, rewards: list[float], g: int, kl: float | None = None):
    """One observed step of len(rewards) // g groups of g, scored by one reward function "main"."""
    n, r = len(rewards), torch.tensor(rewards)
    texts = [f"answer {i} {step}" for i in range(n)]
    return mon.observe(step, rewards=r, per_func={"main": r, "bonus": torch.zeros(n)}, audit={}, texts=texts,
                       token_lists=[[ord(c) for c in t] for t in texts], lengths=torch.full((n,), 10), G=g,
                       entropy=1.0, kl=kl, prompts=[f"p{i // g}" for i in range(n)])


def test_text_statistics_by_hand():
    """2 groups of 2. Group 0: "a b" twice (1 duplicate within the group); group 1: "a b" and "c d".
    "a b" answers both prompts: 3 of 4 completions are cross-prompt duplicates. 4-grams (tokens are
    the characters): "a b" has 0 ("a b" is 3 characters), so use 5-character texts instead below."""
    texts = ["abcde", "abcde", "abcde", "vwxyz"]
    toks = [[ord(c) for c in t] for t in texts]
    s = text_statistics(texts, toks, torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([5, 3, 5, 7]), 2,
                        ["p", "p", "q", "q"])
    assert s["group_duplicates"] == pytest.approx(1 / 4)
    assert s["cross_prompt_duplicates"] == pytest.approx(3 / 4)
    # group 0's 4-grams {abcd, bcde}; group 1's {abcd, bcde, vwxy, wxyz}: 4 distinct of 6 counted
    assert s["distinct_4gram"] == pytest.approx(4 / 6)
    # group 0: rewards (1, 0), lengths (5, 3): corr +1; group 1: (1, 0) vs (5, 7): corr -1
    assert s["length_reward_corr"] == pytest.approx(0.0)
    # one prompt drawn into both groups (a chat prompt: unhashable), answered "abcde" by all 4: duplicates
    # within the prompt only, none across prompts; its 4-grams {abcd, bcde} counted once: 2 distinct of 2
    chat = [{"role": "user", "content": "2+3?"}]
    s = text_statistics(["abcde"] * 4, [toks[0]] * 4, torch.ones(4), torch.full((4,), 5), 2, [chat] * 4)
    assert s["group_duplicates"] == pytest.approx(2 / 4)
    assert s["cross_prompt_duplicates"] == 0.0 and s["distinct_4gram"] == 1.0


def test_a_steady_run_raises_nothing_and_the_gain_needs_two_windows():
    mon = _monitor(audit=True)
    for step in range(1, 21):
        metrics, alarms = _step(mon, step, p_main=0.5, audit=0.5, kl=0.01)
        assert alarms == [] and metrics["health/alarms"] == 0
        assert ("health/reward_gain_z" in metrics) == (step >= 6)  # W = 3: base and recent do not overlap


def test_audit_divergence_fires_when_the_reward_rises_and_the_audit_does_not():
    mon = _monitor(audit=True)
    fired = []
    for step in range(1, 10):
        p = 0.25 if step <= 3 else 0.75  # reward rises by 0.5 (sd of the base: 0.433), z = 1.15
        _, alarms = _step(mon, step, p_main=p, audit=0.1)  # the strict checker does not move
        fired += alarms
    kinds = [(a.kind, a.function, a.step) for a in fired]
    assert kinds == [("audit_divergence", "strict", 6)]  # once, at the first step with two windows
    a = fired[0]
    assert a.value == pytest.approx(0.0) and a.steps == (1, 6) and a.examples and "strict" in a.statistic
    # the audit following the reward: no alarm
    mon = _monitor(audit=True)
    for step in range(1, 10):
        p = 0.25 if step <= 3 else 0.75
        assert _step(mon, step, p_main=p, audit=p)[1] == []


def test_an_audit_at_its_ceiling_cannot_follow_and_alarms_only_if_it_falls():
    """The reward rises 0.25 -> 0.75 (z = 0.5 / 0.433 = 1.15), as above.
    - Audit at 1.0 throughout: no headroom, no rise possible: no alarm. Falling to 0.9: an alarm.
    - Audit 15/16 -> 16/16: base 0.9375, sd sqrt(15/256) = 0.242; the rise it would follow,
      0.25 * 1.15 * 0.242 = 0.070, is capped by the headroom 0.25 * (1 - 0.9375) = 0.0156; it rose
      0.0625, all it could: no alarm (capped at 0.070 it had not followed)."""
    for later, expected in ((1.0, []), (0.9, [("audit_divergence", "strict", 6)])):
        mon, fired = _monitor(audit=True), []
        for step in range(1, 10):
            _, alarms = _step(mon, step, p_main=0.25 if step <= 3 else 0.75, audit=1.0 if step <= 3 else later)
            fired += [(a.kind, a.function, a.step) for a in alarms]
        assert fired == expected
    mon = _monitor(audit=True)
    for step in range(1, 10):
        audit = [0.0] + [1.0] * 15 if step <= 3 else [1.0] * 16
        assert _step(mon, step, p_main=0.25 if step <= 3 else 0.75, audit=audit)[1] == []


def test_a_base_without_spread_floors_the_sd():
    """8 groups of 8; the first W = 3 steps score nothing (n = 192 completions, sd 0), then one success
    in 64 per step: gain 1/64. The sd floor is that of 193 scores with one at the other end of the range
    taken (0..1): sqrt(1/193 * 192/193) = 0.0718, so z = 0.2176, under min_gain_z: a held-out drop of one
    prompt in 20 (0.10 -> 0.05) is not eval_divergence (divided by 1e-6, z was 15625 and it fired). A
    real rise (16 of 64: z = 3.48) with the same drop is."""
    for later, z, expected in ((1, 0.015625 / 0.0717958, []), (16, 0.25 / 0.0717958, ["eval_divergence"])):
        mon = HealthMonitor(HealthThresholds(), ["main"], [1.0], [])
        mon.observe_eval(0, 0.10)
        for step in range(1, 7):
            metrics, alarms = _observe(mon, step, [0.0] * 64 if step <= 3 else [1.0] * later + [0.0] * (64 - later), 8)
            assert alarms == []
        assert metrics["health/reward_gain_z"] == pytest.approx(z, rel=1e-4)
        assert [a.kind for a in mon.observe_eval(6, 0.05)] == expected


def test_component_dominance_needs_the_main_objective_flat():
    mon, fired = _monitor(), []
    for step in range(1, 8):
        _, alarms = _step(mon, step, p_main=0.25, p_bonus=0.0 if step <= 3 else 1.0)
        fired += alarms
    assert [(a.kind, a.function) for a in fired] == [("component_dominance", "bonus")]
    mon = _monitor()  # the bonus rises with the main objective: learning, not hacking
    for step in range(1, 8):
        up = step > 3
        assert _step(mon, step, p_main=0.75 if up else 0.25, p_bonus=1.0 if up else 0.0)[1] == []


def _dominance(names: list[str], weights: list[float], steps: list[dict[str, list[float]]]) -> list[tuple]:
    """component_dominance alarms over steps of per-function scores (32 completions, groups of 8)."""
    mon, fired = HealthMonitor(HealthThresholds(), names, weights, []), []
    for step, scores in enumerate(steps, 1):
        per_func = {n: torch.tensor(scores[n]) for n in names}
        total = sum(w * torch.nan_to_num(per_func[n]) for n, w in zip(names, weights))
        _, alarms = mon.observe(step, rewards=total, per_func=per_func, audit={},
                                texts=[f"completion {step} {i}" for i in range(32)],
                                token_lists=[[step, i, i + 1, i + 2, i + 3] for i in range(32)],
                                lengths=torch.full((32,), 5.0), G=8, entropy=1.0, kl=None,
                                prompts=[f"p{i // 8}" for i in range(32)])
        fired += [(a.step, a.kind, a.function) for a in alarms]
    return fired


def _share(p: float) -> list[float]:
    """32 scores, a fraction p of them 1, spread so that every group varies."""
    return [1.0 if (i * 7) % 32 < round(p * 32) else 0.0 for i in range(32)]


def test_component_dominance_weighs_every_main_objective_whatever_its_name():
    """Accuracy and format share the largest weight; accuracy gains, format is flat at 1, the bonus carries
    62 % of the gain. One of the main objectives gained: no alarm. The main objective was picked by
    name on a tie, so "format" (sorting last) stood for both, and renaming accuracy changed the verdict."""
    steps = [{"accuracy": _share(0.3 if s < 3 else 0.45), "format": [1.0] * 32, "bonus": _share(0 if s < 3 else 1)}
             for s in range(6)]
    for first in ("accuracy", "zaccuracy"):
        named = [{first if k == "accuracy" else k: v for k, v in s.items()} for s in steps]
        assert _dominance([first, "format", "bonus"], [1.0, 1.0, 0.2], named) == [], first


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_a_function_that_scores_nothing_in_a_window_leaves_component_dominance_on(weight):
    """A tool-use reward that abstains on every row until the policy calls a tool has no gain over the
    base: it made the total gain NaN, which switched the alarm off for the whole run."""
    steps = [{"accuracy": [0.0] * 32, "bonus": _share(0.1 if s < 3 else 0.9),
              "tool_used": [math.nan] * 32 if s < 3 else _share(0.5)} for s in range(6)]
    assert _dominance(["accuracy", "bonus", "tool_used"], [1.0, 0.2, weight], steps) == [
        (6, "component_dominance", "bonus")]


def test_template_collapse_is_across_prompts_not_within_groups():
    mon, fired = _monitor(), []
    for step in range(1, 8):  # every group converges on its own answer: duplicates within groups only
        texts = [f"the answer is {i // G:03d}" for i in range(4 * G)]
        fired += _step(mon, step, texts=texts)[1]
    assert fired == []
    mon = _monitor()
    for step in range(1, 8):
        texts = [f"reply {i} {step}" for i in range(4 * G)] if step <= 3 else ["\\boxed{7}"] * (4 * G)
        fired += _step(mon, step, texts=texts)[1]
    assert [a.kind for a in fired] == ["template_collapse"] and "another prompt" in fired[0].statistic


def test_reward_crash_kl_spike_and_entropy_collapse():
    mon, fired = _monitor(), []
    for step, p in enumerate([0.5, 0.5, 0.75, 0.75, 0.0, 0.0], start=1):
        fired += _step(mon, step, p_main=p)[1]
    # base sd: 28 ones in 48 -> 0.493. Step 5: 2-step mean 0.375 vs 0.625 (steps 2-3): 0.51 sd, below 0.6;
    # step 6: 0 vs 0.75 (steps 3-4): 1.52 sd
    assert [(a.kind, a.step) for a in fired] == [("reward_crash", 6)]

    # W = 1. Step 1: one right completion in 16 (base sd 0.242); step 2, lucky: one of the 4 prompts solved by
    # all G; then nothing. At step 4 the last 2 steps (mean 0) sit 0.65 sd below steps 1-2 (0.156), over
    # crash_drop_z, but the group means (steps 1-2 against 3-4, pooled: se 0.124, 14 degrees of freedom)
    # put the drop at 1.3 standard errors, under crash_se_z = 3 (3.64 at 14 degrees of freedom): which
    # prompts were drawn, not a crash. No alarm.
    one, lucky, none = [1.0] + [0.0] * (4 * G - 1), [1.0] * G + [0.0] * 3 * G, [0.0] * 4 * G
    mon = _monitor(window=1)
    assert [a.kind for s, r in enumerate([one, lucky, none, none], 1) for a in _step(mon, s, rewards=r)[1]] == []
    strict = _monitor(window=1, crash_se_z=0.0)  # the same stream judged by the sd alone: an alarm
    assert [a.kind for s, r in enumerate([one, lucky, none, none], 1)
            for a in _step(strict, s, rewards=r)[1]] == ["reward_crash"]

    # Prompts that are always solved (group mean 1) or never (0): a step's mean is which were drawn.
    # Steps 1-8 draw 2 of each (0.5); steps 9-10 draw 4 solvable (1.0), steps 11-12 one (0.25). Against
    # the best earlier window (steps 9-10: 1.0, every group at 1, so no spread) step 12 is 1.5 sd and
    # 4.6 standard errors down, an alarm for a sound run; against the level of steps 5-10 (0.667, 24
    # group means, se 0.098) it is 0.83 sd and 2.2 standard errors down: no alarm.
    def drawn(solvable):
        return [1.0 if g < solvable else 0.0 for g in range(4) for _ in range(G)]

    draws = [2] * 8 + [4, 4, 1, 1]
    mon = _monitor()
    assert [a.kind for s, k in enumerate(draws, 1) for a in _step(mon, s, rewards=drawn(k))[1]] == []
    mon, fired = _monitor(), []  # the same run, except that steps 11-12 solve nothing: a crash
    for s, k in enumerate(draws[:10] + [0, 0], 1):
        fired += [(a.kind, s, a.steps) for a in _step(mon, s, rewards=drawn(k))[1]]
    # 1.33 sd and 3.87 standard errors below steps 5-10 (the 24 + 8 group means' pooled standard error 0.172,
    # over the completions' 0.072), over 3.27, the 3-standard-error level of a t-test of 30 degrees of freedom
    assert fired == [("reward_crash", 12, (5, 12))]

    # One prompt per step (G = 8, W = 1): the level is step 1 (one group mean), the last 2 steps two equal
    # group means: their spread is 0. Step 1: 6 of 8 (base sd sqrt(0.75 * 0.25) = 0.433); steps 2-3: 2 of 8
    # each: 0.5 below, 1.15 sd. The completions, 6 of 8 against 4 of 16, pooled: mean 10/24, variance
    # 10/24 * 14/24 * 24/23 = 0.2536, standard error sqrt(0.2536 * (1/8 + 1/16)) = 0.218: 2.3 standard
    # errors, under 3: no alarm (the group means alone gave 0, floored at 1e-6: 500000). 7 of 8 then none
    # (base sd 0.331): 0.875 down, 2.65 sd and 4.35 standard errors (pooled mean 7/24, standard error
    # 0.201), but 3 group means give a t-test 1 degree of freedom, whose 3-standard-error level is 235.8:
    # three prompts of unlike difficulty could do that. No alarm. Six steps at 7 of 8 (W = 3) and then
    # none twice: 8 group means, 6 degrees of freedom (level 4.90); the completions pooled: mean 42/64,
    # variance 42/64 * 22/64 * 64/63 = 0.2292, standard error sqrt(0.2292 * (1/48 + 1/16)) = 0.138: 6.3
    # standard errors, a crash.
    def few(first, later, window=1, steps=1):
        mon = _monitor(window=window)
        rows = [[1.0] * first + [0.0] * (8 - first)] * steps + [[1.0] * later + [0.0] * (8 - later)] * 2
        return [(a.kind, a.value) for s, r in enumerate(rows, 1) for a in _observe(mon, s, r, 8)[1]]

    assert few(6, 2) == [] and few(7, 0) == []
    assert health.t_critical(3.0, 1) == pytest.approx(235.80, abs=0.01)  # tan(pi (1/2 - P(normal > 3)))
    assert health.t_critical(3.0, 2) == pytest.approx(19.207, abs=1e-3)  # (2p - 1) / sqrt(2p (1 - p))
    assert health.t_critical(3.0, 6) == pytest.approx(4.904, abs=1e-3) and health.t_critical(3.0, 0) == math.inf
    assert few(7, 0, window=3, steps=6) == [("reward_crash", pytest.approx(0.875 / math.sqrt(7 / 64)))]

    mon = _monitor()
    kinds = [[a.kind for a in _step(mon, s, kl=k)[1]] for s, k in enumerate([0.01, 0.02, 0.01, 0.5, 2.0], 1)]
    assert kinds == [[], [], [], [], ["kl_spike"]]  # 0.5 is 25x the median but below 1; 2.0 is both

    # only the 2W = 6 steps before count: after 20 steps at KL 5 and 6 at 0.1, a KL of 1.5 is 15x
    # their median (0.1) and fires, though the median of every earlier step (5) would hide it
    mon = _monitor()
    kls = [5.0] * 20 + [0.1] * 6 + [1.5]
    fired = [(a.kind, s, a.value) for s, k in enumerate(kls, 1) for a in _step(mon, s, kl=k)[1] if a.kind == "kl_spike"]
    assert fired == [("kl_spike", 27, 1.5)]

    # a skipped non-finite step logs a NaN KL: it is neither judged nor part of the median (0.025 of
    # the other five), so the spike at step 7 is seen wherever the NaN falls
    for at in range(6):
        kls = [0.02, 0.03, 0.02, 0.03, 0.02, 0.03, 2.0]
        kls[at] = math.nan
        mon = _monitor()
        assert [(a.kind, s) for s, k in enumerate(kls, 1) for a in _step(mon, s, kl=k)[1]] == [("kl_spike", 7)]

    mon, fired = _monitor(), []
    for step in range(1, 8):  # deterministic without learning
        fired += [(a.kind, step) for a in _step(mon, step, entropy=1.0 if step <= 3 else 0.05)[1]]
    assert fired == [("entropy_collapse", 6)]
    mon = _monitor()
    for step in range(1, 8):  # deterministic because it solved the task
        assert _step(mon, step, entropy=1.0 if step <= 3 else 0.05, p_main=0.25 if step <= 3 else 1.0)[1] == []


def test_eval_divergence_and_rollback_reset_and_state():
    mon = _monitor()
    assert mon.observe_eval(0, 0.40) == []
    for step in range(1, 8):
        _step(mon, step, p_main=0.25 if step <= 3 else 0.75)
    assert mon.observe_eval(7, 0.38) == []  # 2 points: within eval_drop
    alarms = mon.observe_eval(8, 0.30)
    assert [a.kind for a in alarms] == ["eval_divergence"] and a_steps(alarms) == (0, 8)

    unstable = _monitor()  # held-out and training reward fall together: instability, not hacking
    for step in range(1, 11):
        _step(unstable, step, p_main=0.25 if step <= 3 else 1.0 if step <= 7 else 0.5)
        if step in (7, 10):
            assert unstable.observe_eval(step, 0.60 if step == 7 else 0.30) == []

    state = pickle.loads(pickle.dumps(mon.state_dict()))
    copy = _monitor()
    copy.load_state_dict(state)
    assert json.dumps(copy.history) == json.dumps(mon.history)  # (NaN != NaN in a dict comparison)
    assert copy.base_sd == mon.base_sd and copy.fired == mon.fired and json.dumps(copy.evals) == json.dumps(mon.evals)

    mon = _monitor()
    for step, p in enumerate([0.5, 0.5, 0.75, 0.75, 0.0, 0.0], start=1):
        alarms = _step(mon, step, p_main=p)[1]
    assert [a.kind for a in alarms] == ["reward_crash"]
    mon.reset_after_rollback(2)  # the policy of step 2 is back: later history dropped, alarm re-armed
    assert [r["step"] for r in mon.history] == [1, 2]
    assert [a.kind for a in _step(mon, 7, p_main=0.0)[1]] == []  # 2-step mean 0.25 vs 0.5: 0.5 sd
    assert [a.kind for a in _step(mon, 8, p_main=0.0)[1]] == ["reward_crash"]


def test_a_rollback_restores_a_policy_that_sampled_no_crashed_step():
    """Snapshots every W = 3 steps (two kept); snapshot k holds the weights after update k, which sample
    step k + 1. A crash at step 8 judges steps 7 and 8, sampled by snapshots 6 and 7: the target is the
    newest at or before step 8 - 3 = 5, snapshot 3 (sampled step 4, part of the level), not 6. At step 2
    none is that old: the oldest kept, step 0."""
    cfg = TrainConfig(model="m", train_data="d", reward_funcs=["f"], on_collapse="rollback")
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def run_to(alarm_step, cfg=cfg):
        guard = RunGuard(cfg, ["f"], [], is_main=True)
        for step in range(alarm_step):  # the trainer snapshots after each step's update (step 0: the start)
            with torch.no_grad():
                model.weight.fill_(float(step))
            guard.snapshot(step, model, opt)
        return [s for s, _ in guard.snapshots], guard.restore(alarm_step, model, opt, sched)["rollback/to_step"]

    assert run_to(8) == ([3, 6], 3) and model.weight.item() == 3.0
    assert run_to(2) == ([0], 0) and model.weight.item() == 0.0
    # window 1: a snapshot every step, three kept, so one is 3 steps old (with two, the target was
    # always step s - 2, a policy that sampled the crash)
    every_step = TrainConfig(model="m", train_data="d", reward_funcs=["f"], on_collapse="rollback",
                             health_thresholds={"window": 1.0})
    assert run_to(9, every_step) == ([6, 7, 8], 6) and model.weight.item() == 6.0


def a_steps(alarms):
    return alarms[0].steps


@pytest.mark.parametrize("overrides, message", [
    (dict(health_thresholds={"windw": 3}), "health_thresholds: unknown windw"),
    (dict(health_thresholds={"window": 2.5}), "health_thresholds: window=2.5 must be a whole number of steps"),
    (dict(metric_for_best_model="accuracy"), "metric_for_best_model='accuracy' needs an eval set"),
    (dict(audit_funcs=["no_such_reward"]), "no_such_reward"),
    (dict(metric_for_best_model="rewards/digit_fractoin", eval_fraction=0.1),  # else found after the whole run
     r"metric_for_best_model='rewards/digit_fractoin' names no reward function: the eval reports "
     r"rewards/digit_fraction \(did you mean 'rewards/digit_fraction'\?\)"),
    (dict(reward_funcs=["math_accuracy"], train_data="gold"), r"reward function 'math_accuracy' reads the dataset "
     r"column 'answer' or 'solution', which train_data lacks \(its columns: prompt, gold\): add it, or rename the "
     "column that holds it"),
    (dict(audit_funcs=[{"name": "cosine_length", "max_len": 8}], train_data="gold"), "reward function "
     "'cosine_length' reads the dataset column 'answer' or 'solution', which train_data lacks"),
    (dict(reward_funcs=["code_tests"], eval_data="gold"), "reward function 'code_tests' reads the dataset column "
     "'tests', which train_data lacks"),
])
def test_run_health_settings_fail_before_any_model_loads(make_cfg, monkeypatch, tmp_path, overrides, message):
    import grouprl.trainer as trainer_module

    gold = tmp_path / "gold.jsonl"  # the gold answer in a column no built-in reads
    gold.write_text("".join(f'{{"prompt": "{i} + 1 = ", "gold": "{i + 1}"}}\n' for i in range(8)))
    overrides = {k: str(gold) if v == "gold" else v for k, v in overrides.items()}
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(trainer_module, "load_policy", no_load)
    monkeypatch.setattr(trainer_module, "policy_tokenizer", no_load)
    with pytest.raises(ConfigError, match=message):
        Trainer(make_cfg(**overrides))


def test_bad_health_config_is_named():
    with pytest.raises(ConfigError, match="health_thresholds: unknown windw; the thresholds are"):
        RunGuard(TrainConfig(model="m", train_data="d", reward_funcs=["f"], health_thresholds={"windw": 3}),
                 ["f"], [], is_main=True)
    with pytest.raises(ConfigError, match="on_collapse='rewind' is not one of"):
        TrainConfig(model="m", train_data="d", reward_funcs=["f"], on_collapse="rewind").validate()
    with pytest.raises(ConfigError, match="rollback_lr_factor=0"):
        TrainConfig(model="m", train_data="d", reward_funcs=["f"], rollback_lr_factor=0.0).validate()


# ---------------------------------------------------------------------------- through the trainer
def exact_answer(prompts, completions, answer, **kwargs):
    """The strict checker: the completion is exactly the row's answer (a random policy never is)."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def test_a_gameable_reward_is_flagged_with_examples_and_stop_ends_the_run(make_cfg, tmp_path):
    """The reward pays 0.2 for digits (a bonus the tiny policy climbs) and 1 for the exact answer
    (which it never finds); the audit is the exact answer again. Both hacking alarms fire, the run
    stops after that step with a checkpoint, and samples.jsonl shows the offending completions."""
    cfg = make_cfg(reward_funcs=["tests.trainer.test_health:exact_answer", "tests.trainer.conftest:digit_fraction"],
                   reward_weights=[1.0, 0.2], audit_funcs=["tests.trainer.test_health:exact_answer"],
                   on_reward_hacking="stop", max_steps=30, learning_rate=1e-2)
    with pytest.raises(TrainingStopped) as stop:
        Trainer(cfg).train()
    assert stop.value.code == HEALTH_EXIT_CODE and "reward-hacking alarm" in stop.value.reason
    rows = read_metrics(cfg.output_dir)
    flagged = [r for r in rows if r.get("alarms")]
    assert len(flagged) == 1 and flagged[0]["step"] == stop.value.step == rows[-1]["step"]
    kinds = {(a["kind"], a["function"]) for a in flagged[0]["alarms"]}
    assert kinds & {("audit_divergence", "exact_answer"), ("component_dominance", "digit_fraction")}
    assert all(r["audit/exact_answer/mean"] == 0.0 for r in rows if "audit/exact_answer/mean" in r)
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    shown = [s for s in samples if s.get("alarm")]
    assert shown and all(s["step"] == stop.value.step and "completion" in s for s in shown)
    assert stop.value.checkpoint.is_dir()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_by"] == stop.value.reason


def test_a_learning_rate_far_too_high_is_rolled_back(make_cfg):
    """lr 3.0 wrecks the tiny policy in one step (the reward crashes, the KL to the reference
    explodes): on_collapse rollback restores the step-0 weights and scales the learning rate."""
    cfg = make_cfg(learning_rate=3.0, beta=0.04, max_steps=6, on_collapse="rollback", rollback_lr_factor=0.001,
                   max_rollbacks=2)
    trainer = Trainer(cfg)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    restored = []
    original = trainer.rollback

    def spy():
        out = original()
        restored.append(all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters()))
        return out

    trainer.rollback = spy
    trainer.train()
    rows = read_metrics(cfg.output_dir)
    rolled = [r for r in rows if "rollback/count" in r]
    assert rolled and rolled[0]["rollback/to_step"] == 0 and restored[0]
    assert rolled[0]["lr"] == pytest.approx(3.0 * 0.001)
    assert {a["family"] for a in rolled[0]["alarms"]} == {"collapse"}
    assert rows[-1]["lr"] <= 3.0 * 0.001 + 1e-12  # the scaled rate stays
    assert trainer.guard.rollbacks == len(rolled) <= 2


def test_rollbacks_spent_on_the_resume_point_say_where_to_go_back_to(make_cfg, capsys):
    """lr 3.0 wrecks the policy at step 1; killed before step 2 and resumed from the step-1 checkpoint,
    the run's only rollback target is that wrecked state (the uninterrupted run goes back to step 0 and
    recovers): it spends its rollbacks there and stops, and the reason says that every rollback went
    to the resume point and that no earlier checkpoint is kept (a review's run stopped saying only
    "after max_rollbacks=2 rollbacks")."""
    cfg = make_cfg(learning_rate=3.0, beta=0.04, max_steps=6, on_collapse="rollback", rollback_lr_factor=0.001,
                   max_rollbacks=2, save_steps=1)

    class Crash(Exception):
        pass

    trainer = Trainer(cfg)
    original = trainer.train_step

    def crash_before_step_2():
        if trainer.step == 1:
            raise Crash
        return original()

    trainer.train_step = crash_before_step_2
    with pytest.raises(Crash):
        trainer.train()
    capsys.readouterr()
    with pytest.raises(TrainingStopped) as stop:
        Trainer(cfg).train(resume=True)
    said = "".join(capsys.readouterr())  # the guard says it where it says its alarms
    rows = read_metrics(cfg.output_dir)
    assert [r["rollback/to_step"] for r in rows if "rollback/count" in r] == [1, 1]
    assert "after max_rollbacks=2 rollbacks (each back to step 1, where this run resumed)" in stop.value.reason
    assert ("every rollback went back to step 1, the checkpoint this run resumed from, which may already hold the "
            "collapse") in said
    assert "no earlier checkpoint is kept (save_total_limit); start over with a lower learning_rate" in said


def test_the_resume_point_advice_names_the_older_checkpoints_kept(tmp_path):
    """The same stop where checkpoints before the resume point are kept: they are named, with what to do;
    and no advice where a rollback went elsewhere, or the run did not resume."""
    cfg = TrainConfig(model="m", train_data="d", reward_funcs=["f"], on_collapse="rollback", output_dir=str(tmp_path))
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step-{step:06d}" / "COMPLETE").touch()
    guard = RunGuard(cfg, ["f"], [], is_main=True)
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    guard.load_state_dict({"rollbacks": 0})
    guard.snapshot(6, model, opt)
    guard.targets = [6, 6]
    assert guard._resume_point_advice().endswith(
        f"the kept checkpoints before it: step-000002, step-000004; move the later ones out of "
        f"{tmp_path / 'checkpoints'} and resume with a lower learning_rate")
    guard.targets = [6, 3]
    assert guard._resume_point_advice() == ""
    fresh = RunGuard(cfg, ["f"], [], is_main=True)
    fresh.snapshot(6, model, opt)
    fresh.targets = [6]
    assert fresh._resume_point_advice() == ""


def test_reward_functions_are_watched_under_the_names_they_are_scored_under(make_cfg, digits_data):
    """A functools.partial (no __name__) and one function listed twice, health on, an eval before and after:
    each is named as the scores are keyed (its type's name; `_2` on a repeat), and the monitor reads each
    function's own scores: component = weight x the function's mean (a trainer that named both repeats
    `digit_fraction` failed at step 1 on the partial, read one function's scores twice, and the eval failed
    on `digit_fraction_2`)."""
    cfg = make_cfg(max_steps=2, reward_weights=[1.0, 0.5, 0.25], eval_data=str(digits_data), max_eval_samples=4)
    trainer = Trainer(cfg, reward_funcs=[functools.partial(digit_fraction), digit_fraction, digit_fraction])
    trainer.train()
    assert trainer.reward_names == ["partial", "digit_fraction", "digit_fraction_2"]
    rows = [r for r in read_metrics(cfg.output_dir) if "rewards/partial/mean" in r]
    assert len(rows) == len(trainer.guard.monitor.history) == 2
    for row, seen in zip(rows, trainer.guard.monitor.history):
        m = row["rewards/partial/mean"]
        assert row["rewards/digit_fraction/mean"] == row["rewards/digit_fraction_2/mean"] == m
        assert [seen[f"component/{n}"] for n in trainer.reward_names] == pytest.approx([m, 0.5 * m, 0.25 * m])


def test_health_off_computes_nothing_and_audits_still_log(make_cfg):
    cfg = make_cfg(on_reward_hacking="off", on_collapse="off",
                   audit_funcs=["tests.trainer.test_health:exact_answer"], max_steps=2)
    Trainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    assert all(not any(k.startswith("health/") for k in r) for r in rows)
    assert all(r["audit/exact_answer/mean"] == 0.0 for r in rows) and len(rows) == 2


def test_the_extent_of_each_score_follows_the_history_through_a_resume_and_a_rollback():
    """The lowest and highest score each key has taken (which floors the base sd) are kept a step at a
    time, not read from the whole history each step: after a resume they are the history's, and a
    rollback that drops the steps of an extreme score drops that score from them."""
    mon = _monitor(audit=True)
    for step, (rewards, audit) in enumerate([([0.5] * 16, 0.5), ([2.0] + [0.5] * 15, 0.25), ([0.5] * 16, 0.5),
                                             ([-1.0] + [0.5] * 15, [1.5] + [0.5] * 15)], start=1):
        _step(mon, step, rewards=rewards, audit=audit)
    assert mon._extent("reward") == (-1.0, 2.0) and mon._extent("audit/strict") == (0.25, 1.5)
    copy = _monitor(audit=True)
    copy.load_state_dict(pickle.loads(pickle.dumps(mon.state_dict())))
    assert copy._extent("reward") == (-1.0, 2.0) and copy._extent("audit/strict") == (0.25, 1.5)
    mon.reset_after_rollback(1)  # steps 2-4 were another policy's
    assert mon._extent("reward") == (0.5, 0.5) and mon._extent("audit/strict") == (0.5, 0.5)
    assert mon._extent("never/scored") == (0.0, 0.0)
