"""On-policy distillation against GRPO on the embedded default task, at equal steps.

    HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/distillation.py --seeds 0 1 2 3 4 --steps 20

1. Teacher (cached in --teacher-dir): the shipped start policy trained by `grouprl train` with no
   arguments (the embedded default: GRPO on two-number addition, --teacher-steps steps, 100 by default),
   its final weights saved. It shares the student's character tokenizer.
2. For each seed the arms run one after the other, each from the shipped start policy (the student),
   with the default task's settings (16 prompts x 8 completions, lr 1e-4, 6 tokens, one thread):
   - grpo:     the default config as `grouprl train` runs it: the verifier reward alone, beta 0.04;
   - distill:  algorithm on_policy_distill, teacher_model the teacher: the advantage of each token is
               log pi_teacher - log pi_student of the sampled token, the reward not learned from;
   - mixed:    the default config plus teacher_model and distill_coef 1: A = A_grpo + (log pi_T - log pi_S).
   Every --eval-every steps: held-out greedy accuracy on the 200 eval prompts (`Trainer.evaluate`).
   --num-generations changes G (the task's 8) in every arm: at G = 2 most groups of GRPO are flat
   (no signal), while the teacher scores every token.
3. Prints the median over seeds at each eval step, the median gain per step, and s/step; writes
   --json (benchmarks/results/distillation.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import median

from grouprl.config import TrainConfig
from grouprl.tasks import DEFAULT_TASK
from grouprl.trainer import Trainer

ARMS = {
    "grpo": {},
    "distill": {"algorithm": "on_policy_distill", "beta": None},
    "mixed": {"distill_coef": 1.0},
}


def train_teacher(path: Path, steps: int, out: Path) -> None:
    """The embedded default run (`grouprl train`), its final policy saved to `path`."""
    cfg = TrainConfig.from_dict({**DEFAULT_TASK, "max_steps": steps, "output_dir": str(out / "teacher-run"),
                                 "progress": False, "report_to": [], "save_total_limit": 1})
    trainer = Trainer(cfg)
    summary = trainer.train()
    trainer.model.save_pretrained(path)
    trainer.tokenizer.save_pretrained(path)
    trainer.close()
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    print(f"teacher: {steps} GRPO steps, held-out accuracy {before.get('accuracy')} -> {after.get('accuracy')}",
          flush=True)


def run_arm(arm: str, seed: int, args) -> dict:
    extra = {**ARMS[arm], **({"teacher_model": str(args.teacher_dir)} if arm != "grpo" else {})}
    cfg = TrainConfig.from_dict({**DEFAULT_TASK, "max_steps": args.steps, "seed": seed, "progress": False,
                                 "report_to": [], "num_logged_samples": 0, "num_generations": args.num_generations,
                                 "output_dir": str(args.out / f"{arm}-{seed}"), **extra})
    tr = Trainer(cfg)
    curve = [{"step": 0, "accuracy": tr.evaluate()["accuracy"]}]
    seconds = 0.0
    while tr.step < args.steps:
        t0 = time.perf_counter()
        tr.train_step()
        seconds += time.perf_counter() - t0
        if tr.step % args.eval_every == 0 or tr.step == args.steps:
            curve.append({"step": tr.step, "accuracy": tr.evaluate()["accuracy"]})
    tr.close()
    print(f"{arm:8s} seed {seed}: " + " ".join(f"{p['step']}:{p['accuracy']:.3f}" for p in curve)
          + f"  ({seconds / args.steps:.2f} s/step)", flush=True)
    return {"arm": arm, "seed": seed, "curve": curve, "seconds_per_step": seconds / args.steps}


def table(results: list[dict], arms: list[str]) -> str:
    """Median held-out accuracy at each eval step, median gain per step to it, and median s/step."""
    steps = [p["step"] for p in results[0]["curve"]]
    head = "| step | " + " | ".join(f"{a}: accuracy | {a}: gain/step" for a in arms) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(arms))]
    for k, step in enumerate(steps):
        cells = []
        for arm in arms:
            curves = [r["curve"] for r in results if r["arm"] == arm]
            acc = median(c[k]["accuracy"] for c in curves)
            gain = median((c[k]["accuracy"] - c[0]["accuracy"]) / step for c in curves) if step else None
            cells += [f"{100 * acc:.1f} %", "—" if gain is None else f"{100 * gain:+.2f} pt"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    speed = ", ".join(f"{a} {median(r['seconds_per_step'] for r in results if r['arm'] == a):.2f}" for a in arms)
    seeds = sorted({r["seed"] for r in results})
    return "\n".join(lines) + f"\n\nmedians over seeds {seeds}; s/step (median): {speed}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--num-generations", type=int, default=DEFAULT_TASK["num_generations"])
    ap.add_argument("--teacher-steps", type=int, default=100)
    ap.add_argument("--teacher-dir", type=Path, default=Path("/tmp/grouprl-distill-teacher"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/grouprl-distill-bench"))
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/distillation.json"))
    args = ap.parse_args()
    if not (args.teacher_dir / "config.json").is_file():
        train_teacher(args.teacher_dir, args.teacher_steps, args.out)
    results = []
    for seed in args.seeds:  # the arms alternate within a seed: the machine's load hits all alike
        for arm in args.arms:
            results.append(run_arm(arm, seed, args))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=1))
    print(table(results, args.arms))


if __name__ == "__main__":
    main()
