"""PPO (a learned value head, GAE) against GRPO in the same trainer: peak memory, s/step, and held-out
gain per step over seeds.

    python benchmarks/ppo_vs_grpo.py memory --workload 50m --steps 4
    python benchmarks/ppo_vs_grpo.py memory --workload smollm2 --model models/smollm2 --steps 4
    python benchmarks/ppo_vs_grpo.py learning --seeds 1 2 3 4 5 --steps 20

`memory`: each arm (`--arms`, default grpo ppo) runs in its own subprocess, one after the other
(`--repeats` rounds, alternating), so peak RSS is per arm. Workloads:
- `50m`: the 52.5 M-parameter random-init Qwen2 of grouprl.tasks.testing (vs_trl.py's "50m-128":
  "What is a+b? Answer: " prompts, G = 8 x 2 prompts, 128 completion tokens, micro-batch 2, fp32);
- `smollm2`: SmolLM2-135M-Instruct (`--model`, a Hugging Face folder) on chat arithmetic (vs_trl.py's
  "smollm2-135m": G = 8 x 2 prompts, 64 tokens, micro-batch 16, fp32).
Both arms take the same settings (beta `--beta`, default 0: no reference model in either; lr, sizes);
only `algorithm` differs (grpo: group-std advantages, seq-mean-token-mean; ppo: the value head, GAE,
token-mean). The first step is a warm-up; s/step is the median of the others. Reported per arm:
peak RSS (ru_maxrss), the RSS before the model loaded (imports only), their difference, and both as
multiples of |θ|, the policy's parameter bytes (fp32: 4 per parameter).

What is measured is grouprl's PPO: a linear value head on the policy's trunk (value.py), H + 1
parameters. The "PPO needs 3-4|θ|" claim is about a separate critic model (verl, OpenRLHF), which
this benchmark does not run: its cost is stated from its parts (weights, gradients, two Adam moments
in fp32: 4|θ| more, before its activations), not measured.

`learning`: the embedded default task (`grouprl train` with no arguments: the shipped 0.5 M policy
on two-number sums, G = 8 x 16 prompts, lr 1e-4, beta 0.04), `--steps` steps per run, per seed and
arm; held-out greedy accuracy (200 prompts) before and after, from the run's summary.json. Each run
is its own subprocess, seed by seed, arm by arm. One JSON line per run goes to `--out`. With
`--workload smollm2 --model DIR` each run is examples/smollm2_chat_arithmetic.yaml (SmolLM2-135M-
Instruct, chat arithmetic, G = 8 x 2 prompts, 64 tokens, lr 2e-5, beta 0, bf16 where native) and the
accuracy is the lenient one on its 64 held-out prompts:

    python benchmarks/ppo_vs_grpo.py learning --workload smollm2 --model models/smollm2 --seeds 1 2 3 4 5 --steps 20
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = ("grpo", "ppo")
WORKLOADS = {  # name -> (task, max completion tokens, micro_batch_size, prompts per step, lr)
    "50m": ("sum", 128, 2, 2, 1e-5),
    "smollm2": ("chat", 64, 16, 2, 2e-5),
    "tiny": ("sum", 16, 16, 2, 1e-5),  # the smoke test's
}


def current_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_memory(arm: str, workload: str, model_dir: str, steps: int, threads: int, beta: float) -> dict:
    """One arm in this process: RSS before the model, then `steps` + 1 train steps; peak RSS and times."""
    import torch
    from datasets import Dataset

    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer
    from vs_trl import REWARDS, make_rows, peak_rss_mib, reward_funcs

    torch.set_num_threads(threads)
    task, tokens, micro, prompts, lr = WORKLOADS[workload]
    base = current_rss_bytes()
    with tempfile.TemporaryDirectory() as out:
        names, weights = REWARDS[task]
        cfg = TrainConfig(model=model_dir, train_data="<in memory>", reward_funcs=list(names), reward_weights=weights,
                          algorithm=arm, beta=beta, num_generations=8, prompts_per_step=prompts,
                          max_completion_length=tokens, temperature=1.0, learning_rate=lr, bf16=False,
                          micro_batch_size=micro, max_steps=steps + 1, output_dir=out, progress=False, report_to=[],
                          num_logged_samples=0, num_threads=threads, seed=0, reward_timeout_s=None)
        trainer = Trainer(cfg, train_dataset=Dataset.from_list(make_rows(task)), reward_funcs=reward_funcs(task))
        theta = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        head = trainer.updater.value_head
        head_bytes = 0 if head is None else sum(p.numel() * p.element_size() for p in head.parameters())
        times, lengths = [], []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            m = trainer.train_step()
            if i:  # the first step is a warm-up
                times.append(time.perf_counter() - t0)
                lengths.append(m["completion/length_mean"])
    return {"arm": arm, "workload": workload, "theta_bytes": theta, "head_bytes": head_bytes, "base_rss": base,
            "peak_rss": int(peak_rss_mib() * 2**20), "times": times, "lengths": lengths}


SMOLLM2_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_chat_arithmetic.yaml"


def worker_learning(arm: str, seed: int, steps: int, model_dir: str | None = None) -> dict:
    """One run with `algorithm: arm`, accuracy before and after: the embedded default task, or with
    `model_dir` (SmolLM2-135M-Instruct) examples/smollm2_chat_arithmetic.yaml (64 held-out prompts,
    greedy, lenient accuracy)."""
    from grouprl.cli import main as cli_main

    config = [str(SMOLLM2_EXAMPLE), "--model", model_dir] if model_dir else []
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        code = cli_main(["train", *config, "--algorithm", arm, "--seed", str(seed), "--max_steps", str(steps),
                         "--eval_steps", "0", "--output_dir", out, "--progress", "false", "--report_to", "[]"])
        seconds = time.perf_counter() - t0
        if code:
            raise SystemExit(code)
        summary = json.loads((Path(out) / "summary.json").read_text())
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    return {"arm": arm, "seed": seed, "steps": steps, "before": before, "after": after,
            "gain_per_step": (after - before) / steps, "seconds": seconds}


def subprocess_json(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU's figures
        subprocess.run([sys.executable, __file__, *args, "--worker-out", f.name], check=True, env=env)
        return json.loads(Path(f.name).read_text())


def mib(x: float) -> str:
    return f"{x / 2**20:,.0f} MiB"


def memory_table(runs: list[dict]) -> str:
    theta = runs[0]["theta_bytes"]
    head = max(r["head_bytes"] for r in runs)
    lines = [f"|θ| = {mib(theta)} ({theta / 4 / 1e6:.1f} M parameters, fp32); value head {head} bytes", "",
             "| arm | peak RSS | × |θ| | peak − RSS before the model | × |θ| | s/step (median) | completion tokens |",
             "|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        peak = max(r["peak_rss"] for r in mine)
        grown = max(r["peak_rss"] - r["base_rss"] for r in mine)
        times = [t for r in mine for t in r["times"]]
        length = statistics.median(x for r in mine for x in r["lengths"])
        lines.append(f"| {arm} | {mib(peak)} | {peak / theta:.2f} | {mib(grown)} | {grown / theta:.2f} | "
                     f"{statistics.median(times):.2f} | {length:.1f} |")
    lines.append("")
    lines.append(f"A separate critic (verl, OpenRLHF; not measured here) would add its weights, gradients and two "
                 f"Adam moments: 4|θ| = {mib(4 * theta)} in fp32, before its activations.")
    return "\n".join(lines)


def learning_table(runs: list[dict]) -> str:
    lines = ["| arm | seeds | accuracy before | after (median, min..max) | gain per step (median, min..max) | "
             "s per run (median) |", "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        after = [r["after"] for r in mine]
        gain = [100 * r["gain_per_step"] for r in mine]
        lines.append(f"| {arm} | {len(mine)} | {100 * mine[0]['before']:.1f} % | "
                     f"{100 * statistics.median(after):.1f} % "
                     f"({100 * min(after):.1f}..{100 * max(after):.1f}) | {statistics.median(gain):.2f} points "
                     f"({min(gain):.2f}..{max(gain):.2f}) | {statistics.median(r['seconds'] for r in mine):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measure", choices=("memory", "learning"))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--workload", default="50m", choices=sorted(WORKLOADS),
                    help="memory: the model and task; learning: smollm2 runs examples/smollm2_chat_arithmetic.yaml, "
                         "any other the embedded default task")
    ap.add_argument("--model", help="the model folder for --workload smollm2 (a Hugging Face folder)")
    ap.add_argument("--steps", type=int, default=None, help="memory: steps after the warm-up (default 4); "
                    "learning: steps per run (default 20)")
    ap.add_argument("--repeats", type=int, default=1, help="memory: rounds of the arms, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.0, help="memory: both arms' beta (0: no reference model)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--out", help="append one JSON line per run here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        result = (worker_memory(args.worker, args.workload, args.model_dir, args.steps, args.threads, args.beta)
                  if args.measure == "memory" else worker_learning(args.worker, args.seed, args.steps, args.model_dir))
        Path(args.worker_out).write_text(json.dumps(result))
        return

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.measure == "memory":
            steps = 4 if args.steps is None else args.steps
            if args.workload == "smollm2":
                if not args.model:
                    sys.exit("--workload smollm2 needs --model (the SmolLM2-135M-Instruct folder)")
                model_dir = args.model
            else:
                from grouprl.tasks.testing import save_tiny_model

                model_dir = str(save_tiny_model(Path(tmp) / args.workload, args.workload, seed=0))
            for _ in range(args.repeats):
                for arm in args.arms:
                    print(f"{args.workload}: {arm} ...", flush=True)
                    runs.append(subprocess_json(["memory", "--worker", arm, "--workload", args.workload,
                                                 "--model-dir", model_dir, "--steps", str(steps), "--threads",
                                                 str(args.threads), "--beta", str(args.beta)]))
                    r = runs[-1]
                    print(f"{arm}: peak RSS {mib(r['peak_rss'])} (before the model {mib(r['base_rss'])}), "
                          f"s/step {statistics.median(r['times']):.2f}; load {os.getloadavg()[0]:.2f}", flush=True)
            text = memory_table(runs)
        else:
            steps = 20 if args.steps is None else args.steps
            on = []  # the embedded task, or SmolLM2 on chat arithmetic
            if args.workload == "smollm2":
                if not args.model:
                    sys.exit("--workload smollm2 needs --model (the SmolLM2-135M-Instruct folder)")
                on = ["--model-dir", args.model]
            for seed in args.seeds:
                for arm in args.arms:
                    runs.append(subprocess_json(["learning", "--worker", arm, "--seed", str(seed),
                                                 "--steps", str(steps), *on]))
                    r = runs[-1]
                    print(f"seed {seed} {arm}: {100 * r['before']:.1f} % -> {100 * r['after']:.1f} % "
                          f"in {r['seconds']:.0f} s", flush=True)
            text = learning_table(runs)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in runs)
    print(text)


if __name__ == "__main__":
    main()
