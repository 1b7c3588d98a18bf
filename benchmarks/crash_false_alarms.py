"""How often `reward_crash` fires on a sound run that is not learning: a stationary policy, no training.

    python benchmarks/crash_false_alarms.py                       # 1, 2, 4, 16 prompts per step
    python benchmarks/crash_false_alarms.py --prompts 2 --runs 1000 --steps 40

Each run feeds the health monitor (health.py, at its defaults) `steps` steps of `prompts` prompts, G
completions each. A prompt's pass rate is drawn anew for every prompt from U(0, 1) (prompts differ in
difficulty, which moves a step's mean by which prompts it drew) or, with `--rate p`, fixed at p; each
completion scores 1 with that rate, else 0. Nothing changes the policy, so every alarm is a false
one; a run counts once, at its first `reward_crash`. Every run has its own seed (run k of B prompts:
seed B * 100000 + k), so two trees compared on the same runs differ only by their rule.
"""

from __future__ import annotations

import argparse
import random

import torch

from grouprl.health import HealthMonitor, HealthThresholds


def first_crash(B: int, G: int, steps: int, rng: random.Random, rate: float | None) -> int | None:
    """The step of a stationary run's first reward_crash alarm, or None."""
    monitor = HealthMonitor(HealthThresholds(), ["accuracy"], [1.0], [])
    for step in range(1, steps + 1):
        rates = [rng.random() if rate is None else rate for _ in range(B)]
        rewards = torch.tensor([float(rng.random() < p) for p in rates for _ in range(G)])  # [B * G]
        texts = [f"step {step} completion {i}" for i in range(B * G)]
        _, alarms = monitor.observe(step, rewards=rewards, per_func={"accuracy": rewards}, audit={}, texts=texts,
                                    token_lists=[[i, step, 1, 2, 3] for i in range(B * G)],
                                    lengths=torch.full((B * G,), 5), G=G, entropy=1.0, kl=None,
                                    prompts=[f"prompt {step}.{i // G}" for i in range(B * G)])
        if any(a.kind == "reward_crash" for a in alarms):
            return step
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 4, 16], help="prompts per step (B)")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt")
    ap.add_argument("--steps", type=int, default=20, help="steps per run")
    ap.add_argument("--runs", type=int, default=400, help="runs per number of prompts")
    ap.add_argument("--rate", type=float, default=None, help="every prompt's pass rate (default: U(0, 1) each)")
    args = ap.parse_args()
    print("| prompts per step | runs | runs with a reward_crash | share | median step of the first |")
    print("|---|---|---|---|---|")
    for B in args.prompts:
        hits = [first_crash(B, args.G, args.steps, random.Random(B * 100000 + k), args.rate) for k in range(args.runs)]
        fired = sorted(h for h in hits if h is not None)
        median = fired[len(fired) // 2] if fired else "-"
        print(f"| {B} | {args.runs} | {len(fired)} | {len(fired) / args.runs:.1%} | {median} |")


if __name__ == "__main__":
    main()
