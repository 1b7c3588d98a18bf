"""Learning per step, grouprl against TRL's GRPOTrainer: held-out gain after the same steps, over seeds.

    python benchmarks/learning_vs_trl.py --task embedded --seeds 1 2 3 4 5 6 7 8 9 10
    python scripts/fetch_smollm2.py models/smollm2                                   # once
    python benchmarks/learning_vs_trl.py --task smollm2 --model models/smollm2 --seeds 1 2 3 4 5
    python benchmarks/learning_vs_trl.py --task embedded --arms grouprl grouprl-beta2 grouprl-linear trl

Tasks:
- `embedded`: the embedded default (`grouprl train` with no arguments: the shipped 0.5 M policy on
  two-number sums, "58+67=" -> "125"), its rewards (`math_accuracy` + 0.2 x `format_reward`), G = 8
  x 16 prompts, 6 tokens, lr 1e-4, beta 0.04; 20 steps (mid-curve, where a difference shows).
- `smollm2`: SmolLM2-135M-Instruct on chat arithmetic ("What is 37+48? Put the final answer in
  \\boxed{}."), last number right + 0.5 x the right number boxed, G = 8 x 4 prompts, 64 tokens,
  lr 2e-5, beta 0, 40 steps. 256 training problems are held out (with the 64 eval problems: 320).

Arms, one change at a time from each side's defaults:
- `grouprl`: grouprl's defaults (bf16: auto, which autocasts only on a CPU or GPU with native bf16;
  Adam beta2 0.99; constant learning rate);
- `grouprl-fp32`: `bf16: false` (the same as `grouprl` where the CPU has no native bf16);
- `grouprl-beta2`: Adam beta2 0.999 (TRL's); `grouprl-linear`: linear decay to 0 (TRL's);
  `grouprl-as-trl`: all three of TRL's (fp32, beta2 0.999, linear decay);
- `trl`: TRL 1.x at the same settings, fp32, its own defaults otherwise (beta2 0.999, linear decay),
  with `loss_type="grpo"` and group-std scaling as grouprl's `grpo` preset;
- `trl-bf16`: TRL with `bf16=True`, only where the CPU has native bf16 (skipped otherwise).

One evaluator scores every arm's start and final model: transformers' greedy `generate` in fp32
on the held-out prompts (200 for `embedded`, 320 for `smollm2`), the answer read by the task's
accuracy reward (`math_accuracy`). Each run is its own subprocess; the order is seed by seed, arm
by arm, so the arms alternate in time on a shared machine. One JSON line per run goes to --out
(default benchmarks/results/learning_vs_trl.jsonl); the table gives, per arm, the median gain and
its spread (min..max and the interquartile range) over seeds, and the median wall time per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
ARMS = ("grouprl", "grouprl-fp32", "grouprl-beta2", "grouprl-linear", "grouprl-as-trl", "trl", "trl-bf16")
HELD_OUT_TRAIN = 256  # smollm2: training problems held out for the evaluation


def task_settings(task: str, model: str) -> dict:
    """The shared settings of a task: rows, rewards, sizes; each side maps them to its own config."""
    from grouprl.tasks import DEFAULT_POLICY_DIR, DEFAULT_TASK, builtin_dataset

    if task == "embedded":
        return dict(model=str(DEFAULT_POLICY_DIR), train=builtin_dataset("arithmetic/train"),
                    held_out=builtin_dataset("arithmetic/eval"),
                    rewards=["math_accuracy", "grouprl.tasks.arithmetic:format_reward"], weights=[1.0, 0.2],
                    G=8, B=16, tokens=6, lr=DEFAULT_TASK["learning_rate"], beta=DEFAULT_TASK["beta"], steps=20,
                    threads=1)
    if task == "smollm2":
        train = builtin_dataset("chat_arithmetic/train")
        return dict(model=model, train=train[HELD_OUT_TRAIN:],
                    held_out=train[:HELD_OUT_TRAIN] + builtin_dataset("chat_arithmetic/eval"),
                    rewards=["math_accuracy", "grouprl.tasks.chat_arithmetic:boxed_accuracy"], weights=[1.0, 0.5],
                    G=8, B=4, tokens=64, lr=2e-5, beta=0.0, steps=40, threads=None)
    raise SystemExit(f"unknown task {task!r}: embedded or smollm2")


def reward_objects(names: list[str]) -> list:
    from grouprl.rewards import resolve_reward_spec

    return [resolve_reward_spec(n) for n in names]


# ---------------------------------------------------------------------------- one run per process
def train_grouprl(arm: str, s: dict, seed: int, steps: int, out: str) -> str:
    from datasets import Dataset

    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    changes = {"grouprl": {}, "grouprl-fp32": {"bf16": False}, "grouprl-beta2": {"adam_beta2": 0.999},
               "grouprl-linear": {"lr_scheduler_type": "linear"},
               "grouprl-as-trl": {"lr_scheduler_type": "linear", "adam_beta2": 0.999, "bf16": False}}[arm]
    cfg = TrainConfig(model=s["model"], train_data="<in memory>", reward_funcs=s["rewards"],
                      reward_weights=s["weights"], num_generations=s["G"], prompts_per_step=s["B"],
                      micro_batch_size=s["G"] * s["B"], max_completion_length=s["tokens"], learning_rate=s["lr"],
                      beta=s["beta"], temperature=1.0, max_steps=steps, seed=seed, output_dir=out, progress=False,
                      report_to=[], num_threads=s["threads"], accuracy_reward="math_accuracy",
                      **changes)
    trainer = Trainer(cfg, train_dataset=Dataset.from_list(s["train"]))
    trainer.train()
    trainer.close()
    return str(Path(out) / "checkpoints" / f"step-{steps:06d}" / "model")


def train_trl(arm: str, s: dict, seed: int, steps: int, out: str) -> str:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    if s["threads"]:
        torch.set_num_threads(s["threads"])
    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    n = s["G"] * s["B"]
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=n, num_generations=s["G"], generation_batch_size=n,
        gradient_accumulation_steps=1, max_completion_length=s["tokens"], temperature=1.0, learning_rate=s["lr"],
        beta=s["beta"], epsilon=0.2, num_iterations=1, loss_type="grpo", scale_rewards="group",
        reward_weights=s["weights"], bf16=arm == "trl-bf16", use_cpu=True, use_vllm=False, max_steps=steps,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=seed,
        dataloader_num_workers=0, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_objects(s["rewards"]), args=args,
                          train_dataset=Dataset.from_list(s["train"]), processing_class=tok)
    trainer.train()
    final = Path(out) / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    return str(final)


def held_out_accuracy(model_dir: str, rows: list[dict], max_new_tokens: int, batch: int = 32) -> float:
    """The one evaluator: greedy `generate` in fp32, answers read by `math_accuracy`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grouprl.rewards import resolve_reward_spec

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    accuracy = resolve_reward_spec("math_accuracy")
    right = 0.0
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        chat = not isinstance(part[0]["prompt"], str)
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) if chat
                 else r["prompt"] for r in part]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.pad_token_id)
        outs = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": o}] for o in outs] if chat else outs
        right += sum(x or 0.0 for x in accuracy([r["prompt"] for r in part], completions,
                                                answer=[r["answer"] for r in part]))
    return right / len(rows)


def worker(arm: str, task: str, model: str, seed: int, steps: int | None) -> dict:
    s = task_settings(task, model)
    steps = steps or s["steps"]
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        final = (train_trl if arm.startswith("trl") else train_grouprl)(arm, s, seed, steps, out)
        seconds = time.perf_counter() - t0
        after = held_out_accuracy(final, s["held_out"], s["tokens"])
    return {"arm": arm, "task": task, "seed": seed, "steps": steps, "eval_after": after,
            "train_seconds": round(seconds, 1)}


# ---------------------------------------------------------------------------- the driver
def table(results: list[dict], before: float) -> str:
    lines = [f"held-out accuracy of the starting model: {before:.3f}",
             "| arm | seeds | median gain (points) | min .. max | interquartile | median s/run |",
             "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in results):
        gains = sorted(100 * (r["eval_after"] - before) for r in results if r["arm"] == arm)
        q = statistics.quantiles(gains, n=4) if len(gains) > 1 else [gains[0], gains[0], gains[0]]
        secs = statistics.median(r["train_seconds"] for r in results if r["arm"] == arm)
        lines.append(f"| {arm} | {len(gains)} | {statistics.median(gains):+.1f} | {gains[0]:+.1f} .. {gains[-1]:+.1f} "
                     f"| {q[0]:+.1f} .. {q[2]:+.1f} | {secs:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="embedded", choices=("embedded", "smollm2"))
    ap.add_argument("--arms", nargs="+", default=["grouprl", "grouprl-fp32", "trl", "trl-bf16"], choices=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's)")
    ap.add_argument("--model", default="models/smollm2", help="SmolLM2 folder for --task smollm2")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/learning_vs_trl.jsonl"),
                    help="JSONL file the results are appended to ('' for none)")
    ap.add_argument("--worker", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.task, args.model, int(args.worker[1]), args.steps)))
        return

    import torch

    from grouprl.precision import native_bf16

    native, why = native_bf16(torch.device("cpu"))
    arms = [a for a in args.arms if native or not a.endswith("bf16")]
    for skipped in sorted(set(args.arms) - set(arms)):
        print(f"{skipped}: skipped, no native bf16 here ({why})")
    s = task_settings(args.task, args.model)
    before = held_out_accuracy(s["model"], s["held_out"], s["tokens"])
    results = []
    for seed in args.seeds:
        for arm in arms:
            cmd = [sys.executable, __file__, "--task", args.task, "--model", args.model, "--worker", arm, str(seed)]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            if proc.returncode:
                raise SystemExit(f"{arm} seed {seed} failed:\n{proc.stderr[-3000:]}")
            r = {**json.loads(proc.stdout.strip().splitlines()[-1]), "eval_before": before}
            results.append(r)
            print(json.dumps(r), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print(table(results, before))


if __name__ == "__main__":
    main()
