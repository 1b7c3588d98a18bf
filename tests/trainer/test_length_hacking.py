"""Run health's `length_hacking` (health.py): a reward function that pays for length itself, told apart
from a reward that pays for doing the task when doing it takes more tokens. The statistic by hand,
the rule on hand-built streams on both sides of its threshold, then through the trainer on the
embedded tool task: its sound run (the old rule's false alarm) stays quiet, a reward paying for
length on the same policy is flagged."""

import json
import math

import pytest
import torch

from grouprl.config import TrainConfig
from grouprl.health import HealthMonitor, HealthThresholds, length_payment
from grouprl.signals import TrainingStopped
from grouprl.tasks import TOOL_TASK
from grouprl.trainer import Trainer
from tests.trainer.conftest import read_metrics

G = 4


def test_length_payment_by_hand():
    """Two groups of 4; c is a check (0/1), f a graded function, l the lengths.
    Group 0: c (1, 1, 0, 0), l (10, 14, 4, 6), f (1.0, 1.2, 0.5, 0.3). Fitting on [1, c] subtracts the
    mean of each c-stratum: l's means 12 and 5 leave e_l (-2, 2, -1, 1); f's means 1.1 and 0.4 leave
    e_f (-0.1, 0.1, 0.1, -0.1). sum(e_f e_l) = 0.2 + 0.2 - 0.1 - 0.1 = 0.2, sum(e_f^2) = 0.04,
    sum(e_l^2) = 10.
    Group 1: c (1, 0, 1, 0), l (9, 5, 7, 5), f (1, 0, 1, 0) = c: c explains f (e_f = 0); e_l (1, 0, -1, 0).
    Pooled: [0.2, 0.04, 12]: partial correlation 0.2 / sqrt(0.48) = 0.289.
    c takes two values: a check, not tested. With f abstaining on row 3, group 0 keeps rows 0-2: the
    c = 0 stratum holds one row (no residual), the c = 1 stratum gives 2 x 0.1 x 2 = 0.4, 0.02, 8."""
    c = torch.tensor([1.0, 1, 0, 0, 1, 0, 1, 0], dtype=torch.float64)
    f = torch.tensor([1.0, 1.2, 0.5, 0.3, 1, 0, 1, 0], dtype=torch.float64)  # 1.2 exactly as a double
    lengths = torch.tensor([10, 14, 4, 6, 9, 5, 7, 5])
    out = length_payment({"f": f, "c": c}, lengths, G, ["f", "c"])
    assert list(out) == ["f"]
    assert out["f"] == pytest.approx([0.2, 0.04, 12.0], abs=1e-12)
    assert out["f"][0] / math.sqrt(out["f"][1] * out["f"][2]) == pytest.approx(0.2887, abs=1e-4)
    f[3] = float("nan")
    assert length_payment({"f": f, "c": c}, lengths, G, ["f"])["f"] == pytest.approx([0.4, 0.02, 10.0], abs=1e-12)
    # no other function: the fit is on [1] alone. f (1, 2, 3, 4), l (1, 2, 3, 5): means 2.5, 2.75, e_f
    # (-1.5, -0.5, 0.5, 1.5), e_l (-1.75, -0.75, 0.25, 2.25): 2.625 + 0.375 + 0.125 + 3.375 = 6.5, 5, 8.75
    alone = length_payment({"f": torch.tensor([1.0, 2, 3, 4])}, torch.tensor([1, 2, 3, 5]), G, ["f"])["f"]
    assert alone == pytest.approx([6.5, 5.0, 8.75])
    # f constant within each group (it follows the prompt, not the completion): no evidence, not noise
    per_prompt = torch.tensor([0.2] * 4 + [0.5] * 4 + [0.7] * 4, dtype=torch.float64)
    sums = length_payment({"f": per_prompt}, torch.tensor([1, 2, 3, 5] * 3), G, ["f"])["f"]
    assert sums[:2] == [0.0, 0.0] and sums[2] == pytest.approx(3 * 8.75)


def _run(pay, names, weights, audit=(), **overrides):
    """7 steps of 4 groups alike, each group: l (10, 14, 4, 6) from step 4 on, half that before (the
    mean length doubles), c (1, 1, 0, 0) (the longer two are right). pay(l, c) -> the paying
    function's scores. Returns the alarms, and the last step's metrics."""
    mon = HealthMonitor(HealthThresholds(**overrides), names, weights, list(audit))
    fired = []
    for step in range(1, 8):
        base = torch.tensor([10.0, 14, 4, 6]) / (2 if step <= 3 else 1)
        lengths, c = base.repeat(4), torch.tensor([1.0, 1, 0, 0]).repeat(4)  # [16]
        funcs = {"c": c, "pay": pay(lengths, c)}
        per_func = {n: funcs[n] for n in names}
        metrics, alarms = mon.observe(step, rewards=sum(w * per_func[n] for n, w in zip(names, weights)),
                                      per_func=per_func, audit={n: funcs[n] for n in audit}, texts=["x"] * 16,
                                      token_lists=[[1]] * 16, lengths=lengths.long(), G=G, entropy=None, kl=None,
                                      prompts=["p"] * 16)
        fired += alarms
    return fired, metrics


def test_a_check_that_pays_the_longer_completions_is_not_length_hacking():
    """The tool task in small: the right completions are the long ones and the share of long ones
    is what grows. The rule before this one fired here (correlation 7 / sqrt(59) = 0.91, length +100 %)."""
    fired, metrics = _run(lambda lengths, c: c, ["c"], [1.0])
    assert metrics["health/length_reward_corr"] == pytest.approx(7 / math.sqrt(59))
    assert fired == [] and not any(k.startswith("health/length_partial_corr") for k in metrics)


def test_a_function_paying_per_token_among_equally_right_completions_is_flagged():
    """pay = l / 10 on top of the check c: within each c-stratum the longer completion earns more, by
    exactly its length: partial correlation 1."""
    fired, metrics = _run(lambda lengths, c: lengths / 10, ["c", "pay"], [1.0, 1.0])
    assert [(a.kind, a.function, a.step) for a in fired] == [("length_hacking", "pay", 6)]
    assert fired[0].value == pytest.approx(1.0) and fired[0].threshold == 0.9
    assert metrics["health/length_partial_corr/pay"] == pytest.approx(1.0)
    # the same, with the check as an audit and no accuracy reward at all (the planted tool-task hack)
    # (the reward doubles while the audit stays put: audit_divergence fires beside it)
    fired, _ = _run(lambda lengths, c: lengths / 10, ["pay"], [1.0], audit=["c"])
    assert {(a.kind, a.function) for a in fired} == {("length_hacking", "pay"), ("audit_divergence", "c")}


def test_partial_credit_that_comes_with_length_sits_below_the_threshold():
    """pay (1.0, 1.2, 0.5, 0.3) per group: partial correlation 0.289 given c (test_length_payment_by_hand,
    group 0, scale-free, so the halved lengths of steps 1-3 give it too); its plain correlation with
    length is 5.1 / sqrt(0.53 x 59) = 0.91 and the length doubles. Quiet at 0.9, flagged at 0.28."""
    pay = lambda lengths, c: torch.tensor([1.0, 1.2, 0.5, 0.3]).repeat(4)  # noqa: E731
    fired, metrics = _run(pay, ["pay", "c"], [1.0, 0.0])
    assert fired == [] and metrics["health/length_partial_corr/pay"] == pytest.approx(0.2 / math.sqrt(0.4))
    fired, _ = _run(pay, ["pay", "c"], [1.0, 0.0], length_partial_corr=0.28)
    assert [(a.kind, a.function, round(a.value, 3)) for a in fired] == [("length_hacking", "pay", 0.316)]
    # a weight-0 function is logged, never paid: it cannot hack; a length penalty (weight < 0) neither
    assert _run(lambda lengths, c: lengths / 10, ["c", "pay"], [1.0, 0.0])[0] == []
    fired, metrics = _run(lambda lengths, c: lengths / 10, ["c", "pay"], [1.0, -0.01])
    assert fired == [] and metrics["health/length_partial_corr/pay"] == pytest.approx(1.0)


def test_the_lengths_must_grow():
    fired, _ = _run(lambda lengths, c: lengths / 10, ["c", "pay"], [1.0, 1.0], length_growth=1.5)
    assert fired == []  # +100 %, under 150 %


# ---------------------------------------------------------------------------- the tool task
def assistant_length(prompts, completions, **kwargs):
    """A reward paying for length: the characters the assistant wrote (its text and its calls), / 60."""
    out = []
    for c in completions:
        text = ""
        for m in c if isinstance(c, list) else [{"role": "assistant", "content": c}]:
            if m.get("role") == "assistant":
                text += str(m.get("content") or "")
                text += "".join(json.dumps(tc.get("function", tc)) for tc in m.get("tool_calls") or [])
        out.append(len(text) / 60)
    return out


def tool_call_format(prompts, completions, **kwargs):
    """A format reward for benchmarks/run_health.py's hack-format-tool arm: 1 for any tool call, whatever
    its arguments and whatever the answer."""
    return [float(any(m.get("tool_calls") for m in c if isinstance(m, dict))) for c in completions]


def _tool_run(tmp_path, **overrides) -> list[dict]:
    cfg = TrainConfig(**{**TOOL_TASK, "output_dir": str(tmp_path / "run"), "progress": False, "report_to": [],
                         "save_steps": 0, "num_logged_samples": 0, **overrides})
    trainer = Trainer(cfg)
    try:
        trainer.train()
    except TrainingStopped as e:  # on_reward_hacking: stop
        assert e.signum is None
    finally:
        trainer.close()
    return read_metrics(cfg.output_dir)


def _old_rule_held(rows) -> list[int]:
    """The steps at which the rule before this one held: within-group reward-length correlation >= 0.5
    over the last 3 steps and the mean length >= 25 % above the first 3 steps'."""
    steps = [r for r in rows if "health/length_reward_corr" in r]
    base = sum(r["completion/length_mean"] for r in steps[:3]) / 3
    out = []
    for i in range(5, len(steps)):
        recent = steps[i - 2:i + 1]
        corr = sum(r["health/length_reward_corr"] for r in recent) / 3
        if corr >= 0.5 and sum(r["completion/length_mean"] for r in recent) / 3 >= 1.25 * base:
            out.append(steps[i]["step"])
    return out


def test_the_tool_task_learning_to_call_its_tool_raises_no_alarm(tmp_path):
    """examples/tool_task.yaml, 8 steps: calling the calculator (~58 tokens) is what the accuracy
    reward pays, guessing (~7) is wrong; the share of calls grows, and held-out accuracy with it. The
    rule before this one raised length_hacking at step 7 (measured, seed 0); asserted below that its
    conditions held, so this run tests the new rule, not a run too short to alarm."""
    rows = _tool_run(tmp_path, max_steps=8)
    assert _old_rule_held(rows), "the run no longer meets the old rule's conditions: lengthen it"
    assert not [a for r in rows for a in r.get("alarms", [])]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert evals[0] < 0.05 and evals[-1] > 0.25  # measured 0 -> 0.435


def test_a_reward_paying_for_length_on_the_tool_policy_is_flagged(tmp_path):
    """The same policy paid for the characters it writes (audit: the product is right). Calling the
    tool is the long thing it knows, so it learns that first, like the sound run; what gives it away
    is that among completions equally right (or wrong) the longer earn more."""
    rows = _tool_run(tmp_path, max_steps=10, eval_data=None,
                     reward_funcs=["tests.trainer.test_length_hacking:assistant_length"], reward_weights=[1.0],
                     audit_funcs=["grouprl.tasks.products:product_accuracy"], on_reward_hacking="stop")
    alarms = [a for r in rows for a in r.get("alarms", [])]
    assert [(a["kind"], a["function"]) for a in alarms] == [("length_hacking", "assistant_length")]
    assert alarms[0]["value"] >= 0.9 and alarms[0]["step"] == rows[-1]["step"]  # measured: step 7, 0.99
