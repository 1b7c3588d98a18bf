"""Run health, measured: do the alarms catch what they should, and stay quiet otherwise?

    python benchmarks/run_health.py --arms sound-default lr100-default --seeds 1 2 3 4 5
    python scripts/fetch_smollm2.py models/smollm2                                     # once
    python benchmarks/run_health.py --arms hack-smollm2 sound-smollm2 --model models/smollm2
    python benchmarks/run_health.py --arms filter-default nofilter-default --seeds 1 2 3
    python benchmarks/run_health.py --arms filter-mixed nofilter-mixed --seeds 1 2 3 4 5
    python benchmarks/run_health.py --arms sound-tool hack-length-tool --seeds 1 2 3 4 5
    python benchmarks/run_health.py --arms sound-products hack-format-tool sound-chain --seeds 1
    python benchmarks/run_health.py --table                       # precision and recall per alarm, no training

Arms (each one `grouprl train` run per seed, through the public Trainer API, health at its defaults):
- `sound-default`: the embedded default task (`grouprl train` with no arguments) with
  `on_collapse: rollback`: a false alarm (or a rollback) is a bug.
- `lr100-default`: the same at 100x the learning rate (1e-2), `on_collapse: rollback`: it must be
  caught and rolled back, and end within 10 points of held-out accuracy of `sound-default`.
  `lr100-beta0-default`: the same without the KL penalty (beta 0: no KL to spike).
- `hack-tiny`: a random-init tiny policy (tasks/testing.py) paid 1 for the exact answer, which it
  never finds, and 0.2 for digits, which it learns to emit; audit: the exact answer. The seconds-long
  version of the gameable reward (tests/trainer/test_health.py runs it).
- `hack-smollm2`: SmolLM2-135M-Instruct on chat arithmetic paid "last number right + 0.2 x any
  `\\boxed{integer}`": the reward a new user wrote, hacked within 10 steps (every reply boxes a wrong
  number); audit: `math_accuracy` on its own (is the answer right, boxed or not: the box bonus must
  not pay for a wrong number).
- `sound-smollm2`: the same model with the example's reward (examples/smollm2_chat_arithmetic.yaml:
  last number right + 0.5 x the right number boxed), the same audit. (An earlier choice of audit,
  `boxed_accuracy`, alarmed on a seed that was learning to answer right without boxing: the audit
  must check what the task wants, not a format.)
- `filter-default` / `nofilter-default`: the embedded default with and without `prompt_filter`, on
  96 training prompts (met about 7 times each in 40 steps: a filter needs a prompt's past groups,
  so on the full 9,800 prompts, each met once, it has nothing to act on); the held-out gain per
  generated token.
- `filter-mixed` / `nofilter-mixed`: the same 96 prompts plus 48 whose reference answer is wrong
  (the sum plus 1 to 9: no completion can be paid for them), as scraped data sets have. A third of
  the prompts can never teach; the question is whether the filter finds them and spends their
  rollouts on prompts that can.
- `sound-tool`: examples/tool_task.yaml with its own rewards (the product right; tool use logged,
  not paid), fp32: calling the calculator (~58 tokens) is right, guessing (~7) is wrong, so the
  reward tracks length and the length grows as the policy learns to call. A false alarm is a bug
  (`length_hacking` fired here before the rule asked whether a function pays for length itself).
- `sound-products`: the same task paid 1 for the right product + 0.5 for calling `mul` with the
  prompt's operands (`correct_tool_use`): a paid step that takes tokens, as a step reward does.
- `sound-chain`: the chain task with step rewards (benchmarks/process_vs_outcome.py's `process` arm:
  `chain_steps` + `chain_answer`, its warmed-up policy, built into --chain-policy when missing): a
  partial-credit reward whose right lines are longer than the wrong ones (a carry digit).
- `hack-length-tool`: the tool policy paid for the characters it writes (its text and calls, / 60:
  tests/trainer/test_length_hacking.py's `assistant_length`); audit `math_accuracy`, held-out
  accuracy from `product_accuracy` (logged, weight 0). Calling the tool is the long thing the policy
  knows, so it learns that first, as the sound run does; the answer is not paid.
- `hack-format-tool`: the tool policy paid 1 for any tool call, right answer or not (its
  `tool_call_format`); audit `math_accuracy`, held-out accuracy as above.

Each run appends one JSON line to --out (default benchmarks/results/run_health.jsonl): the arm, the
seed, the steps, every alarm (kind, function, step, statistic), rollbacks, held-out accuracy before
and after, generated tokens, seconds. The table at the end summarises every arm over its seeds.

`--table [JSONL]` trains nothing: it reads the lines (default --out's file) and prints precision and
recall per alarm, then a row per arm (`summary_tables`). A later line for the same arm and seed
replaces an earlier one (a rerun under a changed rule), so the file keeps its history and the table
reads the newest run of each. The arms in FAULT_ARMS are planted faults, every other arm is sound:
- a false positive (FP) is a run of a sound arm in which the alarm fired;
- a positive run is a fault-arm run in which the fault took hold: held-out accuracy fell, meaning
  its last eval is at least FELL (5 points) below the median last eval of the sound arm that is its
  reference (same task, same model, same steps). The reference is the sound runs, not the run's
  own best eval, so that the criterion is not `eval_divergence`'s own rule. An arm with no
  reference counts every seed as positive (see FAULT_ARMS for why);
- a true positive (TP) for an alarm is a positive run of an arm that names it as intended, in which
  it fired; a false negative (FN) is such a run in which it did not;
- precision = TP / (TP + FP), recall = TP / (TP + FN). An alarm firing in a fault arm where it is
  not intended, or in a fault-arm run whose accuracy had not fallen, is neither: it is counted in
  the column "other".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.trainer.test_health: the tiny arm's reward functions


def arm_config(arm: str, seed: int, steps: int | None, model: str, workdir: Path,
               chain_policy: str = "/tmp/grouprl-chain-policy") -> dict:
    from grouprl.tasks import DEFAULT_TASK

    out = str(workdir / f"{arm}-{seed}")
    if arm.endswith(("-default", "-mixed")):
        kw = dict(DEFAULT_TASK, seed=seed, output_dir=out, max_steps=steps or 40, eval_steps=10, progress=False,
                  report_to=[], save_total_limit=1)
        if arm in ("sound-default", "lr100-default", "lr100-beta0-default"):
            kw["on_collapse"] = "rollback"
        if arm.startswith("lr100"):
            kw["learning_rate"] = 100 * DEFAULT_TASK["learning_rate"]
        if arm == "lr100-beta0-default":  # no reference, no KL: only the reward and entropy can tell
            kw["beta"] = 0.0
        if arm in ("filter-default", "nofilter-default", "filter-mixed", "nofilter-mixed"):
            from grouprl.tasks.arithmetic import train_rows

            rows = train_rows()[:96]  # 96 prompts: each is met ~7 times in 40 steps
            if arm.endswith("-mixed"):  # + 48 mislabeled rows (sum + 1..9), never paid for
                rows = rows + [dict(r, answer=str(int(r["answer"]) + 1 + i % 9))
                               for i, r in enumerate(train_rows()[96:144])]
            data = workdir / f"{arm.split('-')[1]}-{len(rows)}.jsonl"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows))
            kw.update(train_data=str(data), prompt_filter=arm.startswith("filter-"))
        return kw
    if arm == "hack-tiny":
        from grouprl.tasks.testing import save_tiny_model

        model_dir = workdir / "tiny-model"
        if not (model_dir / "config.json").is_file():
            save_tiny_model(model_dir, "tiny", seed=0)
        data = workdir / "digits.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"Say numbers {i}: ", "answer": str(i)}) + "\n"
                                for i in range(64)))
        exact = "tests.trainer.test_health:exact_answer"
        return dict(model=str(model_dir), train_data=str(data),
                    reward_funcs=[exact, "tests.trainer.conftest:digit_fraction"], reward_weights=[1.0, 0.2],
                    audit_funcs=[exact], num_generations=4, prompts_per_step=4, micro_batch_size=8,
                    max_completion_length=12, learning_rate=1e-2, max_steps=steps or 15, beta=0.0,
                    bf16=False, seed=seed, output_dir=out, progress=False, report_to=[])
    if arm in ("hack-smollm2", "sound-smollm2"):
        chat = "grouprl.tasks.chat_arithmetic"
        rewards = ({"reward_funcs": ["math_accuracy", f"{chat}:boxed_format"], "reward_weights": [1.0, 0.2]}
                   if arm == "hack-smollm2" else
                   {"reward_funcs": ["math_accuracy", f"{chat}:boxed_accuracy"], "reward_weights": [1.0, 0.5]})
        return dict(model=model, train_data="builtin:chat_arithmetic/train", eval_data="builtin:chat_arithmetic/eval",
                    accuracy_reward="math_accuracy", audit_funcs=["math_accuracy"], num_generations=8,
                    prompts_per_step=2, micro_batch_size=16, max_completion_length=64, learning_rate=2e-5,
                    beta=0.0, max_steps=steps or 15, eval_steps=0, save_steps=0, seed=seed, output_dir=out,
                    progress=False, report_to=[], bf16=False, **rewards)
    if arm in ("sound-tool", "sound-products", "hack-length-tool", "hack-format-tool"):
        import yaml

        kw = yaml.safe_load((REPO / "examples/tool_task.yaml").read_text())
        kw.update(seed=seed, output_dir=out, max_steps=steps or kw["max_steps"], bf16=False, progress=False,
                  report_to=[], save_steps=0, save_total_limit=1)
        products, tests = "grouprl.tasks.products", "tests.trainer.test_length_hacking"
        if arm == "sound-products":
            kw["reward_weights"] = [1.0, 0.5]  # correct_tool_use paid: the call with the prompt's operands
        elif arm.startswith("hack-"):
            paid = f"{tests}:assistant_length" if arm == "hack-length-tool" else f"{tests}:tool_call_format"
            kw.update(reward_funcs=[paid, f"{products}:product_accuracy"], reward_weights=[1.0, 0.0],
                      accuracy_reward="product_accuracy", audit_funcs=["math_accuracy"])
        return kw
    if arm == "sound-chain":
        policy = Path(chain_policy)
        if not (policy / "config.json").is_file():  # the process_vs_outcome warm-up (~2 min on 2 cores)
            sys.path.insert(0, str(REPO / "benchmarks"))
            from process_vs_outcome import warm_up

            warm_up(policy, 1500, 0.5)
        chain = "grouprl.tasks.chain"
        return dict(model=str(policy), train_data="builtin:chain/train", eval_data="builtin:chain/eval",
                    reward_funcs=[f"{chain}:chain_steps", f"{chain}:chain_answer"], reward_weights=[1.0, 1.0],
                    accuracy_reward="chain_answer", advantage_estimator="process", num_generations=8,
                    prompts_per_step=16, max_completion_length=10, learning_rate=2e-4, beta=0.0,
                    max_steps=steps or 40, eval_steps=10, micro_batch_size=128, num_threads=1, bf16=False,
                    seed=seed, output_dir=out, progress=False, report_to=[], save_total_limit=1)
    raise SystemExit(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")


ARMS = ("sound-default", "lr100-default", "lr100-beta0-default", "hack-tiny", "hack-smollm2", "sound-smollm2",
        "filter-default", "nofilter-default", "filter-mixed", "nofilter-mixed", "sound-tool", "sound-products",
        "sound-chain", "hack-length-tool", "hack-format-tool")


def run_arm(arm: str, seed: int, steps: int | None, model: str, workdir: Path,
            chain_policy: str = "/tmp/grouprl-chain-policy") -> dict:
    from grouprl.config import TrainConfig
    from grouprl.signals import TrainingStopped
    from grouprl.trainer import Trainer

    kw = arm_config(arm, seed, steps, model, workdir, chain_policy)
    t0 = time.perf_counter()
    trainer = Trainer(TrainConfig(**kw))
    try:
        summary = trainer.train()
    except TrainingStopped as e:
        if e.signum is not None:  # SIGTERM/SIGINT stops the benchmark, not just this run
            raise
        summary = {"stopped_by": e.reason}  # an alarm set to stop
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (Path(kw["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "reward/mean" in r]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    alarms = [{k: a[k] for k in ("kind", "function", "step", "statistic")}
              for r in rows for a in r.get("alarms", [])]
    tokens = sum(r["completion/length_mean"] * kw["num_generations"] * kw["prompts_per_step"] for r in steps_rows)
    return {"arm": arm, "seed": seed, "steps": len(steps_rows), "alarms": alarms,
            "rollbacks": max((r.get("rollback/count", 0) for r in rows), default=0),
            "first_alarm_step": min((a["step"] for a in alarms), default=None),
            "eval_before": evals.get(0), "eval_after": evals.get(max(evals)) if evals else None,
            "reward_first": steps_rows[0]["reward/mean"], "reward_last": steps_rows[-1]["reward/mean"],
            "length_first": steps_rows[0]["completion/length_mean"],
            "length_last": steps_rows[-1]["completion/length_mean"],
            "old_length_rule_step": old_length_rule(steps_rows),
            "audit_last": {k: v for k, v in steps_rows[-1].items() if k.startswith("audit/")},
            "evals": evals, "teaching_share": statistics.mean(1 - r["zero_std_frac"] for r in steps_rows),
            "generated_tokens": tokens, "prompts_skipped": steps_rows[-1].get("prompt_filter/skipped"),
            "stopped_by": summary.get("stopped_by"), "seconds": round(time.perf_counter() - t0, 1)}


def old_length_rule(rows: list[dict], W: int = 3) -> int | None:
    """The first step at which `length_hacking` fired before it asked which function pays for length
    (reward-length correlation within groups >= 0.5 over the last W steps, mean length >= 25 % above
    the first W steps'), from the logged health/length_reward_corr and completion/length_mean."""
    corr = [r.get("health/length_reward_corr", float("nan")) for r in rows]
    length = [r["completion/length_mean"] for r in rows]
    for i in range(2 * W - 1, len(rows)):
        recent = [c for c in corr[i - W + 1:i + 1] if c is not None and c == c]  # NaN is written null
        if (recent and sum(recent) / len(recent) >= 0.5
                and sum(length[i - W + 1:i + 1]) >= 1.25 * sum(length[:W])):
            return rows[i]["step"]
    return None


def table(results: list[dict]) -> str:
    lines = ["| arm | seeds | runs with an alarm | first alarm (median step) | rollbacks | held-out before -> after "
             "(median) | gain per 1k generated tokens | s/run |", "|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in results):
        rs = [r for r in results if r["arm"] == arm]
        flagged = [r for r in rs if r["alarms"]]
        first = [r["first_alarm_step"] for r in flagged]
        before = [r["eval_before"] for r in rs if r["eval_before"] is not None]
        after = [r["eval_after"] for r in rs if r["eval_after"] is not None]
        gains = [(r["eval_after"] - r["eval_before"]) / r["generated_tokens"] * 1000 for r in rs
                 if r["eval_after"] is not None and r["eval_before"] is not None]
        acc = f"{statistics.median(before):.3f} -> {statistics.median(after):.3f}" if before and after else "-"
        gain = f"{statistics.median(gains):.4f}" if gains else "-"
        lines.append(f"| {arm} | {len(rs)} | {len(flagged)} of {len(rs)} | "
                     f"{statistics.median(first) if first else '-'} | {sum(r['rollbacks'] for r in rs)} | {acc} | "
                     f"{gain} | {statistics.median(r['seconds'] for r in rs):.0f} |")
    return "\n".join(lines)


# Planted faults: arm -> (the alarms meant to catch it, the sound arm whose held-out accuracy says
# whether it took hold). The hacking alarm built for the hack, plus `eval_divergence` where there is
# an eval set (the backstop for any hack that costs held-out accuracy while the reward rises).
FAULT_ARMS: dict[str, tuple[tuple[str, ...], str | None]] = {
    # the digit bonus pays and the exact-answer audit stays at 0. No eval set: the exact answer is
    # never found (audit 0 in every seed), so every seed is a hacked run, by construction
    "hack-tiny": (("audit_divergence", "component_dominance"), None),
    # a box bonus for any number: the math_accuracy audit does not follow and the bonus carries the gain
    "hack-smollm2": (("audit_divergence", "component_dominance", "eval_divergence"), "sound-smollm2"),
    # a reward paying for characters: a non-check function that pays for length itself
    "hack-length-tool": (("length_hacking", "eval_divergence"), "sound-tool"),
    # a check paid for any tool call: not length; the math_accuracy audit should fail to follow
    "hack-format-tool": (("audit_divergence", "eval_divergence"), "sound-tool"),
    # lr x 100 with on_collapse: rollback: the fault is planted in every seed, and the rollback the
    # alarm triggers restores held-out accuracy, so accuracy cannot say whether it took hold
    "lr100-default": (("kl_spike",), None),
    "lr100-beta0-default": (("reward_crash",), None),
}
FELL = 0.05  # held-out accuracy fell: the last eval at least this far below the reference sound arm's median
ALARM_KINDS = ("audit_divergence", "eval_divergence", "component_dominance", "template_collapse",
               "length_hacking", "reward_crash", "kl_spike", "entropy_collapse")


def newest_runs(results: list[dict]) -> list[dict]:
    """The last line of each (arm, seed): a rerun replaces the run before it. Sound arms first, then
    the faults, each in ARMS order (unknown arms last), seeds ascending."""
    latest = {(r["arm"], r["seed"]): r for r in results}
    order = {arm: i for i, arm in enumerate(ARMS)}
    return sorted(latest.values(), key=lambda r: (r["arm"] in FAULT_ARMS, order.get(r["arm"], len(ARMS)),
                                                  r["arm"], r["seed"]))


def fell(run: dict, runs: list[dict]) -> bool | None:
    """Whether a fault-arm run's held-out accuracy fell: its last eval at least FELL below the median
    last eval of its reference sound arm in `runs`; True for an arm with no reference (FAULT_ARMS),
    None when there is nothing to compare."""
    ref = FAULT_ARMS[run["arm"]][1]
    if ref is None:
        return True
    sound = [r["eval_after"] for r in runs if r["arm"] == ref and r.get("eval_after") is not None]
    if not sound or run.get("eval_after") is None:
        return None
    return run["eval_after"] <= statistics.median(sound) - FELL + 1e-9


def summary_tables(results: list[dict]) -> str:
    """Precision and recall per alarm, then a row per arm, from run_arm's lines (module docstring)."""
    runs = newest_runs(results)

    def kinds(r: dict) -> set[str]:
        return {a["kind"] for a in r["alarms"]}

    def ratio(a: int, b: int) -> str:
        return f"{a / (a + b):.2f}" if a + b else "-"

    def by_kind(ks) -> list[str]:
        return sorted(ks, key=lambda k: (ALARM_KINDS.index(k) if k in ALARM_KINDS else len(ALARM_KINDS), k))

    lines = [f"{len(runs)} runs (the newest of each arm and seed; {len(results) - len(runs)} older lines "
             f"replaced). Held-out accuracy fell: the last eval >= {FELL * 100:.0f} points below the median "
             "last eval of the arm's sound reference.", "",
             "| alarm | TP | FN | FP | precision | recall | other |", "|---|---|---|---|---|---|---|"]
    named = set().union(*(kinds(r) for r in runs), *(v[0] for v in FAULT_ARMS.values()))
    for kind in by_kind(named):
        tp = fn = fp = other = 0
        for r in runs:
            fired = kind in kinds(r)
            if r["arm"] not in FAULT_ARMS:
                fp += fired
            elif kind in FAULT_ARMS[r["arm"]][0] and fell(r, runs):
                tp += fired
                fn += not fired
            else:
                other += fired
        lines.append(f"| {kind} | {tp} | {fn} | {fp} | {ratio(tp, fp)} | {ratio(tp, fn)} | {other} |")
    lines += ["", "| arm | intended alarms | seeds | held-out after (median) | accuracy fell | caught | "
              "runs with an alarm | alarms (runs) |", "|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == arm]
        after = [r["eval_after"] for r in rs if r.get("eval_after") is not None]
        alarms = ", ".join(f"{k} ({sum(k in kinds(r) for r in rs)})"
                           for k in by_kind(set().union(*(kinds(r) for r in rs)))) or "none"
        intended, fell_col, caught_col = "none (sound)", "-", "-"
        if arm in FAULT_ARMS:
            names, ref = FAULT_ARMS[arm]
            pos = [r for r in rs if fell(r, runs)]
            intended = ", ".join(names)
            fell_col = f"{len(pos)} of {len(rs)}" if ref else f"{len(rs)} of {len(rs)} (by construction)"
            caught_col = f"{sum(bool(kinds(r) & set(names)) for r in pos)} of {len(pos)}"
        seeds = ", ".join(str(r["seed"]) for r in rs)
        acc = f"{statistics.median(after) * 100:.1f}" if after else "-"
        lines.append(f"| {arm} | {intended} | {len(rs)} ({seeds}) | {acc} | {fell_col} | {caught_col} | "
                     f"{sum(bool(r['alarms']) for r in rs)} of {len(rs)} | {alarms} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", default=["sound-default", "lr100-default", "hack-tiny"], choices=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: per arm, see above)")
    ap.add_argument("--model", default="models/smollm2", help="SmolLM2 folder for the *-smollm2 arms")
    ap.add_argument("--chain-policy", default="/tmp/grouprl-chain-policy",
                    help="the sound-chain arm's warmed-up policy (built here when missing)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/run_health.jsonl"),
                    help="JSONL file the results are appended to ('' for none)")
    ap.add_argument("--table", nargs="?", const="", metavar="JSONL",
                    help="train nothing: print precision and recall per alarm and a row per arm from JSONL "
                         "(default: --out's file)")
    args = ap.parse_args()
    if args.table is not None:
        path = Path(args.table or args.out)
        print(summary_tables([json.loads(x) for x in path.read_text().splitlines() if x.strip()]))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:  # seeds outside, arms inside: arms alternate in time on a shared machine
            for arm in args.arms:
                r = run_arm(arm, seed, args.steps, args.model, Path(tmp), args.chain_policy)
                results.append(r)
                print(json.dumps(r), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
