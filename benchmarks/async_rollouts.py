"""Synchronous against one-step asynchronous rollouts, with the vLLM server (vllm_mode: server) on
this machine's CPU.

    python benchmarks/async_rollouts.py                      # 10m, 3 rounds of 8 steps
    python benchmarks/async_rollouts.py --size 50m --rounds 2 --steps 6

Starts one `grouprl vllm-serve` for the model (vLLM binds its worker to core 0 and leaves core 1),
then runs the two sides alternately (sync, async, sync, async, ... for `--rounds`), each in its own
subprocess pinned to the other core with `--threads` torch threads: the nearest this 2-core
machine comes to generation and training on their own devices. Each run trains `--steps` GRPO
steps of 4 prompts x 8 samples x `--max-tokens` tokens (ignore_eos: every step decodes the same
number of tokens). Per run, the median over steps 3.. of:
- step: the whole step's wall time;
- gen: the engine's generation time (`time/generate_engine`), and wait: how long the trainer
  waited for the batch (`time/generate`; in async mode it was generated during the last update);
- train: old log-probs + the update + the weight sync (`time/logprobs + update + sync_weights`).
Over rounds each figure is the median of the per-run medians.
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
B, G = 4, 8


def worker(side: str, model_dir: str, port: int, max_tokens: int, steps: int, threads: int) -> list[dict]:
    from datasets import Dataset

    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    rows = [{"prompt": f"What is {a}+{a + 7}? Answer: ", "answer": str(2 * a + 7)} for a in range(64)]
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model_dir, train_data="<in memory>", reward_funcs=["math_accuracy"],
                          num_generations=G, prompts_per_step=B, micro_batch_size=8, max_completion_length=max_tokens,
                          ignore_eos=True, learning_rate=1e-5, beta=0.0, max_steps=steps, output_dir=out,
                          progress=False, report_to=[], num_logged_samples=0, num_threads=threads,
                          use_vllm=True, vllm_mode="server", vllm_server_port=port, reward_timeout_s=None,
                          async_rollouts=side == "async", max_staleness=1)
        trainer = Trainer(cfg, train_dataset=Dataset.from_list(rows))
        stages = []
        for _ in range(steps):
            m = trainer.train_step()
            stages.append({k.removeprefix("time/"): v for k, v in m.items() if k.startswith("time/")})
        trainer.close()
    return stages


def start_server(model_dir: str, port: int, log: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    import requests

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "grouprl", "vllm-serve", model_dir, "--port", str(port),
                             "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", *extra],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-serve exited: {log.read_text()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except requests.RequestException:
            time.sleep(1)
    raise RuntimeError("vllm-serve did not come up in 10 minutes")


def run_side(side: str, args, model_dir: str, port: int) -> list[dict]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", side, "--model-dir", model_dir, "--out", f.name,
               "--port", str(port), "--max-tokens", str(args.max_tokens), "--steps", str(args.steps),
               "--threads", str(args.threads)]
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       preexec_fn=lambda: os.sched_setaffinity(0, {args.trainer_core}))
        return json.loads(Path(f.name).read_text())


def summarize(runs: list[list[dict]]) -> dict[str, float]:
    med = statistics.median

    def per_run(stages: list[dict], f) -> float:
        return med([f(s) for s in stages[2:]])

    figures = {"step": lambda s: s["step"], "gen": lambda s: s["generate_engine"], "wait": lambda s: s["generate"],
               "train": lambda s: s["logprobs"] + s["update"] + s["sync_weights"]}
    return {k: med([per_run(r, f) for r in runs]) for k, f in figures.items()} | {
        "step_runs": [round(per_run(r, figures["step"]), 2) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10m", help="grouprl.tasks.testing size")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trainer-core", type=int, default=1)
    ap.add_argument("--port", type=int, default=18555)
    ap.add_argument("--worker"), ap.add_argument("--model-dir"), ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        result = worker(args.worker, args.model_dir, args.port, args.max_tokens, args.steps, args.threads)
        Path(args.out).write_text(json.dumps(result))
        return

    from grouprl.tasks.testing import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(Path(tmp) / args.size, args.size, seed=0))
        server = start_server(model_dir, args.port, Path(tmp) / "server.log")
        try:
            runs: dict[str, list] = {"sync": [], "async": []}
            loads = []
            for _ in range(args.rounds):
                for side in runs:
                    loads.append(round(os.getloadavg()[0], 2))
                    runs[side].append(run_side(side, args, model_dir, args.port))
        finally:
            os.killpg(server.pid, 9)
            server.wait()
    res = {side: summarize(r) for side, r in runs.items()}
    print(f"{args.size}, {B}x{G}x{args.max_tokens} tokens, {args.rounds} rounds x {args.steps} steps, "
          f"1-minute loads at each run's start {loads}")
    for side, r in res.items():
        print(f"  {side:5s} step {r['step']:.2f} s {r['step_runs']}  gen {r['gen']:.2f}  wait {r['wait']:.2f}  "
              f"train {r['train']:.2f}")
    s = res["sync"]
    print(f"  async/sync step time {res['async']['step'] / s['step']:.2f}; from sync's stages: "
          f"max(gen, train) / (gen + train) = {max(s['gen'], s['train']) / (s['gen'] + s['train']):.2f}")


if __name__ == "__main__":
    main()
