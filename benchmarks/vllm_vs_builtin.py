"""Rollouts with colocated vLLM against grouprl's built-in engine, on this machine's CPU.

    python benchmarks/vllm_vs_builtin.py                         # 10m and 50m, 2 rounds
    python benchmarks/vllm_vs_builtin.py --size 50m --rounds 3 --steps 6

For each model size, each side runs in its own subprocess, the sides alternate (builtin, vllm,
builtin, vllm, ... for `--rounds`), and each run waits for an idle CPU first. A run measures:
- generation: `Trainer.generate` of 4 prompts x 8 samples x `--max-tokens` tokens (ignore_eos, so
  both sides compute the same tokens), one warm-up call then `--gen-repeats` timed calls; the
  figure is generated tokens per second;
- training: `--steps` GRPO steps of the same shape through the Trainer (`use_vllm` on or off),
  the median over steps 3.. of the step time and of its generate and weight-sync stages.
Over rounds each figure is the median of the per-run medians. vLLM runs eager (`enforce_eager`):
on CPU its default compiles the model with inductor at start-up, minutes on 2 cores.
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

B, G = 4, 8


def worker(side: str, model_dir: str, max_tokens: int, steps: int, gen_repeats: int, threads: int) -> dict:
    import torch
    from datasets import Dataset

    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    torch.set_num_threads(threads)
    rows = [{"prompt": f"What is {a}+{a + 7}? Answer: ", "answer": str(2 * a + 7)} for a in range(64)]
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model_dir, train_data="<in memory>", reward_funcs=["math_accuracy"],
                          num_generations=G, prompts_per_step=B, micro_batch_size=8, max_completion_length=max_tokens,
                          ignore_eos=True, learning_rate=1e-5, beta=0.0, max_steps=steps, output_dir=out,
                          progress=False, report_to=[], num_logged_samples=0, num_threads=threads,
                          use_vllm=side == "vllm", vllm_enforce_eager=side == "vllm", reward_timeout_s=None)
        trainer = Trainer(cfg, train_dataset=Dataset.from_list(rows))
        prompts = trainer.prompts(rows[:B])  # the config samples at temperature 1, max_tokens, ignore_eos
        gen = torch.Generator().manual_seed(0)
        trainer.generate(prompts, generator=gen)  # warm-up
        tps = []
        for _ in range(gen_repeats):
            t0 = time.perf_counter()
            ro = trainer.generate(prompts, generator=gen).rollout
            tps.append(int(ro.lengths.sum()) / (time.perf_counter() - t0))
        stages = []
        for _ in range(steps):
            m = trainer.train_step()
            stages.append({k.removeprefix("time/"): v for k, v in m.items() if k.startswith("time/")})
        trainer.close()
    return {"tokens_per_s": tps, "stages": stages}


def wait_idle(max_load: float, timeout_s: float = 300) -> float:
    t0 = time.time()
    while os.getloadavg()[0] > max_load and time.time() - t0 < timeout_s:
        time.sleep(10)
    return os.getloadavg()[0]


def run_side(side: str, args, model_dir: str) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", side, "--model-dir", model_dir, "--out", f.name,
               "--max-tokens", str(args.max_tokens), "--steps", str(args.steps),
               "--gen-repeats", str(args.gen_repeats), "--threads", str(args.threads)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())


def summarize(runs: list[dict]) -> dict:
    med = statistics.median
    out = {"tokens_per_s": med([med(r["tokens_per_s"]) for r in runs]),
           "tokens_per_s_runs": [round(med(r["tokens_per_s"]), 1) for r in runs]}
    for key in ("step", "generate", "sync_weights", "update"):
        out[key] = med([med([s.get(key, 0.0) for s in r["stages"][2:]]) for r in runs])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", action="append", help="grouprl.tasks.testing size (repeatable); default 10m, 50m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-load", type=float, default=1.0, help="wait for this 1-minute load before each run")
    ap.add_argument("--worker"), ap.add_argument("--model-dir"), ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        result = worker(args.worker, args.model_dir, args.max_tokens, args.steps, args.gen_repeats, args.threads)
        Path(args.out).write_text(json.dumps(result))
        return

    from grouprl.tasks.testing import save_tiny_model

    for size in args.size or ["10m", "50m"]:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(save_tiny_model(Path(tmp) / size, size, seed=0))
            runs: dict[str, list[dict]] = {"builtin": [], "vllm": []}
            loads = []
            for _ in range(args.rounds):
                for side in runs:
                    loads.append(wait_idle(args.max_load))
                    runs[side].append(run_side(side, args, model_dir))
            res = {side: summarize(r) for side, r in runs.items()}
        b, v = res["builtin"], res["vllm"]
        print(f"{size}, {B}x{G}x{args.max_tokens} tokens, {args.rounds} rounds, loads at start "
              f"{[round(x, 2) for x in loads]}")
        for side, r in res.items():
            print(f"  {side:8s} generate {r['tokens_per_s']:7.1f} tok/s {r['tokens_per_s_runs']}  step "
                  f"{r['step']:.2f} s (generate {r['generate']:.2f}, sync {r['sync_weights']:.3f}, "
                  f"update {r['update']:.2f})")
        print(f"  vllm/builtin: tokens/s {v['tokens_per_s'] / b['tokens_per_s']:.2f}x, "
              f"step time {v['step'] / b['step']:.2f}x")


if __name__ == "__main__":
    main()
