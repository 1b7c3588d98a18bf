"""Process supervision vs outcome-only GRPO on the built-in chain task, at equal steps.

    HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/process_vs_outcome.py --seeds 0 1 2 --steps 40

1. Warm-up (supervised, from scratch, cached in --policy-dir): the 0.54 M-parameter tiny Qwen2 with the
   character tokenizer learns the chain format "3+4+5+8=" -> "7\\n12\\n20" from a mixture: each line is
   the right partial sum with probability --correct-fraction and otherwise that sum with its carry
   dropped (7+5 -> "2"), independently per line, like the shipped arithmetic policy's carry bug.
2. For each seed, the arms run one after the other (alternating, same start weights, same prompts):
   - process:        advantage_estimator: process, reward_funcs [chain_steps, chain_answer] (1, 1):
                     every line is a step rewarded 1 when right, the answer is the final step;
   - outcome:        grpo, reward_funcs [chain_answer]: 1 when the last line is the total;
   - outcome_dense:  grpo, reward_funcs [chain_line_fraction, chain_answer] (1, 1): the same partial
                     credit, summed into one number per completion (no per-token credit).
   Every --eval-every steps: greedy decoding of the 200 held-out problems, the share with every line
   right (`exact`), with the right final answer (`answer`) and the share of right lines (`lines`).
3. Writes benchmarks/results/process_vs_outcome.json and a plot (--plot).

With --preflight-check (and e.g. --steps 10 --json benchmarks/results/process_preflight.json),
each arm and seed instead runs `Trainer.preflight()` on the starting policy and then --steps
training steps: the predicted share of zero-variance groups at G = 8 against the observed one.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

from grouprl.config import TrainConfig
from grouprl.tasks.chain import chain_answer, chain_steps, partial_sums, train_rows
from grouprl.tasks.testing import build_tiny_model
from grouprl.trainer import Trainer

def chain_line_fraction(prompts, completions, steps, **kwargs) -> list[float]:
    """The share of right lines among the expected ones (chain_steps' partial credit as one number)."""
    return [sum(r for _, r in row) / len(gold.split("\n")) for row, gold in
            zip(chain_steps(prompts, completions, steps), steps)]


ARMS = {  # (advantage_estimator, reward functions); reward weights all 1
    "process": ("process", [chain_steps, chain_answer]),
    "outcome": ("grpo", [chain_answer]),
    "outcome_dense": ("grpo", [chain_line_fraction, chain_answer]),
}


# ---------------------------------------------------------------- warm-up
def carry_dropped(a: int, b: int) -> int:
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits


def target(operands: list[int], correct_fraction: float, rng: random.Random) -> str:
    lines, prev = [], operands[0]
    for x, right in zip(operands[1:], partial_sums(operands)):
        lines.append(str(right if rng.random() < correct_fraction else carry_dropped(prev, x)))
        prev = right
    return "\n".join(lines)


def warm_up(path: Path, steps: int, correct_fraction: float, seed: int = 0) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = build_tiny_model("tiny", seed=seed)
    problems = [[int(c) for c in r["prompt"][:-1].split("+")] for r in train_rows()]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    t0 = time.time()
    for step in range(1, steps + 1):
        ids, labels = [], []
        for _ in range(64):
            ops = rng.choice(problems)
            p = tok("+".join(map(str, ops)) + "=")["input_ids"]
            c = tok(target(ops, correct_fraction, rng))["input_ids"] + [tok.eos_token_id]
            ids.append(p + c)
            labels.append([-100] * len(p) + c)
        width = max(map(len, ids))
        x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in ids])  # [64, L]
        y = torch.tensor([s + [-100] * (width - len(s)) for s in labels])  # [64, L]
        logits = model(input_ids=x, attention_mask=(x != tok.pad_token_id).long()).logits  # [64, L, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"warm-up {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)


# ---------------------------------------------------------------- RL arms
@torch.no_grad()
def greedy_eval(tr: Trainer) -> dict[str, float]:
    ds = tr.eval_ds
    texts = tr.decode(tr.generate(tr.prompts(ds), greedy=True))
    exact = answer = lines = total_lines = 0
    for text, row in zip(texts, ds):
        want, got = row["steps"].split("\n"), text.strip().split("\n")
        exact += text.strip() == row["steps"]
        answer += got[-1].strip() == row["answer"]
        lines += sum(k < len(got) and got[k].strip() == w for k, w in enumerate(want))
        total_lines += len(want)
    n = len(ds)
    return {"exact": exact / n, "answer": answer / n, "lines": lines / total_lines}


def arm_trainer(arm: str, seed: int, args, name: str = "") -> Trainer:
    cfg = TrainConfig(model=str(args.policy_dir), train_data="builtin:chain/train", eval_data="builtin:chain/eval",
                      num_generations=8, prompts_per_step=16, max_completion_length=10, learning_rate=args.lr,
                      beta=0.0, max_steps=args.steps, micro_batch_size=128, num_threads=1, seed=seed,
                      output_dir=str(args.out / f"{name}{arm}-{seed}"), progress=False, report_to=[],
                      num_logged_samples=0, advantage_estimator=ARMS[arm][0])
    return Trainer(cfg, reward_funcs=ARMS[arm][1])


def preflight_check(arm: str, seed: int, args) -> dict:
    """Preflight's zero-variance share at G = 8 (64 prompts, the starting policy) against what the
    first --steps training steps observe (`zero_std_frac`), from the same start."""
    tr = arm_trainer(arm, seed, args, name="preflight-")
    report = tr.preflight(num_prompts=64)
    observed = [tr.train_step()["zero_std_frac"] for _ in range(args.steps)]
    tr.close()
    predicted = report["total"]["zero_variance_share"]
    print(f"{arm:14s} seed {seed}: predicted {predicted:.1%}, observed step 1 {observed[0]:.1%}, "
          f"steps 1-{args.steps} {sum(observed) / len(observed):.1%}", flush=True)
    return {"arm": arm, "seed": seed, "predicted": predicted, "observed": observed}


def run_arm(arm: str, seed: int, args) -> dict:
    tr = arm_trainer(arm, seed, args)
    curve = [{"step": 0, **greedy_eval(tr)}]
    t0 = time.time()
    while tr.step < args.steps:
        tr.train_step()
        if tr.step % args.eval_every == 0:
            curve.append({"step": tr.step, **greedy_eval(tr)})
    tr.close()
    print(f"{arm:14s} seed {seed}: " + "  ".join(f"{k} {curve[0][k]:.3f}->{curve[-1][k]:.3f}"
                                                for k in ("exact", "answer", "lines"))
          + f"  ({time.time() - t0:.0f} s)", flush=True)
    return {"arm": arm, "seed": seed, "curve": curve, "seconds": time.time() - t0}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    colors = {"process": "tab:blue", "outcome": "tab:red", "outcome_dense": "tab:green"}
    for ax, key in zip(axes, ("exact", "answer", "lines")):
        for arm in colors:
            runs = [r["curve"] for r in results if r["arm"] == arm]
            if not runs:
                continue
            steps = [p["step"] for p in runs[0]]
            for c in runs:
                ax.plot(steps, [p[key] for p in c], color=colors[arm], alpha=0.25, lw=1)
            ax.plot(steps, [median(c[i][key] for c in runs) for i in range(len(steps))], color=colors[arm],
                    lw=2, label=f"{arm} (median of {len(runs)})")
        ax.set_title({"exact": "every line right", "answer": "final answer right",
                      "lines": "share of right lines"}[key])
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--warmup-steps", type=int, default=1500)
    ap.add_argument("--correct-fraction", type=float, default=0.5)
    ap.add_argument("--policy-dir", type=Path, default=Path("/tmp/grouprl-chain-policy"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/grouprl-process-bench"))
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/process_vs_outcome.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/process_vs_outcome.png"))
    ap.add_argument("--preflight-check", action="store_true",
                    help="instead: preflight's predicted zero-variance share against the first --steps steps")
    args = ap.parse_args()
    if not (args.policy_dir / "config.json").is_file():
        warm_up(args.policy_dir, args.warmup_steps, args.correct_fraction)
    if args.preflight_check:
        checks = [preflight_check(arm, seed, args) for seed in args.seeds for arm in args.arms]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "preflight": checks},
                                        indent=1))
        return
    results = []
    for seed in args.seeds:  # alternate the arms within each seed: the machine's load hits all alike
        for arm in args.arms:
            results.append(run_arm(arm, seed, args))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=1))
            plot(results, args.plot)


if __name__ == "__main__":
    main()
