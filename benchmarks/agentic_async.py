"""The embedded tool task (multi-turn: a calculator call, its result, the answer) against a vLLM
server on this machine's CPU, in three modes: synchronous, one-step asynchronous, and asynchronous
with partial rollouts. Step time and learning at equal steps.

    python benchmarks/agentic_async.py                       # 3 seeds x 3 modes x 30 steps
    python benchmarks/agentic_async.py --seeds 0 --steps 10  # a quick look

One `grouprl vllm-serve` of the shipped tool policy (vLLM binds its worker to core 0), then per seed
the modes run one after another (sync, async, partial, sync, ...), each in its own subprocess pinned
to the other core with one torch thread. Every run is the task's own config (`TOOL_TASK`: 16
prompts x 8 trajectories, 2 turns, 80 tokens, lr 3e-4, 30 steps) in server mode; only the mode and
the seed change. Per run:
- step: the median wall time of steps 3..; gen: the engine's generation time per step
  (`time/generate_engine`); wait: how long the trainer waited for its batch (`time/generate`);
  train: old log-probs + update + weight sync;
- learning: greedy accuracy and correct tool use on the 200 held-out problems before and after,
  and the mean training reward over the last 5 steps;
- staleness and `rollout/partial_frac` (the share of trajectories a weight update overtook).
Results are appended to benchmarks/results/agentic_async.jsonl; the table prints medians over seeds.
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
sys.path.insert(0, str(REPO / "benchmarks"))
MODES = {"sync": {}, "async": {"async_rollouts": True}, "partial": {"async_rollouts": True, "partial_rollouts": True}}


def worker(mode: str, seed: int, port: int, steps: int) -> dict:
    from grouprl.config import TrainConfig
    from grouprl.tasks import TOOL_TASK
    from grouprl.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(**{**TOOL_TASK, "output_dir": out, "max_steps": steps, "eval_steps": 0, "seed": seed,
                             "progress": False, "report_to": [], "num_logged_samples": 0, "use_vllm": True,
                             "vllm_mode": "server", "vllm_server_port": port, "vllm_server_timeout_s": 300,
                             **MODES[mode]})
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        try:
            summary = trainer.train()
        finally:
            trainer.close()
        wall = time.perf_counter() - t0
        rows = [r for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
                if "reward/mean" in r]
    med = statistics.median
    late = rows[2:]
    return {
        "mode": mode, "seed": seed, "steps": steps, "wall_s": round(wall, 2),
        "step": med(r["time/step"] for r in late), "gen": med(r["time/generate_engine"] for r in late),
        "wait": med(r["time/generate"] for r in late),
        "train": med(r["time/logprobs"] + r["time/update"] + r["time/sync_weights"] for r in late),
        "acc_before": summary["eval_before"]["accuracy"], "acc_after": summary["eval_after"]["accuracy"],
        "tool_before": summary["eval_before"]["rewards/correct_tool_use"],
        "tool_after": summary["eval_after"]["rewards/correct_tool_use"],
        "reward_last5": statistics.fmean(r["reward/mean"] for r in rows[-5:]),
        "reward_curve": [round(r["reward/mean"], 3) for r in rows],
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in rows),
        "partial_frac": statistics.fmean(r.get("rollout/partial_frac", 0.0) for r in rows),
    }


def run_one(mode: str, seed: int, args) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", mode, "--seed-one", str(seed), "--out", f.name,
               "--port", str(args.port), "--steps", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, {args.trainer_core}))
        if proc.returncode:
            raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stdout[-4000:]}")
        return json.loads(Path(f.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--trainer-core", type=int, default=1)
    ap.add_argument("--port", type=int, default=18556)
    ap.add_argument("--results", default=str(REPO / "benchmarks/results/agentic_async.jsonl"))
    ap.add_argument("--worker"), ap.add_argument("--seed-one", type=int), ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.worker, args.seed_one, args.port, args.steps)))
        return

    from async_rollouts import start_server

    from grouprl.tasks import TOOL_POLICY_DIR

    modes = args.modes.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(str(TOOL_POLICY_DIR), args.port, Path(tmp) / "server.log")
        try:
            for seed in map(int, args.seeds.split(",")):
                for mode in modes:
                    load = round(os.getloadavg()[0], 2)
                    r = run_one(mode, seed, args) | {"load_at_start": load, "date": time.strftime("%Y-%m-%d")}
                    runs.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "reward_curve"}), flush=True)
                    with open(args.results, "a") as f:
                        f.write(json.dumps(r) + "\n")
        finally:
            os.killpg(server.pid, 9)
            server.wait()

    med = statistics.median
    print(f"\ntool task, {args.steps} steps, seeds {args.seeds}: medians over seeds (range)")
    print("| mode | step | gen | wait | train | greedy acc before → after | tool use after | reward, last 5 |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]

        def m(k, rs=rs):
            return med(r[k] for r in rs)

        accs = sorted(r["acc_after"] for r in rs)
        base = base or m("step")
        print(f"| {mode} | {m('step'):.2f} s ({m('step') / base:.2f}x) | {m('gen'):.2f} s | {m('wait'):.2f} s | "
              f"{m('train'):.2f} s | {100 * m('acc_before'):.1f} → {100 * m('acc_after'):.1f} % "
              f"({100 * accs[0]:.1f}–{100 * accs[-1]:.1f}) | {100 * m('tool_after'):.1f} % | {m('reward_last5'):.3f} |")


if __name__ == "__main__":
    main()
