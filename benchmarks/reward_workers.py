"""The reward stage in the trainer's process against `reward_workers: N` worker processes: a MATH-style
batch whose answers are LaTeX (fractions, roots, powers, intervals, sets), each round with numbers no
earlier round used, so that no remembered parse hides the work. The same `score_completions` call the
trainer makes (math_accuracy and think_format, slices of whole groups); the totals are checked equal.

    python benchmarks/reward_workers.py                            # 16 prompts x 16, workers 1 and 2
    python benchmarks/reward_workers.py --prompts 32 --group 16 --workers 2 4 8 --rounds 5
    python benchmarks/reward_workers.py --prompts 1 --group 128 [--whole-groups]   # one group: cut by rows or not
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from grouprl.rewards import math_accuracy, score_completions, think_format
from grouprl.rewards.workers import RewardWorkers

FORMS = [lambda a, b: f"\\frac{{{a}}}{{{b}}}", lambda a, b: f"\\sqrt{{{a}}} + {b}", lambda a, b: f"{a}^{{{b % 5 + 2}}}",
         lambda a, b: f"[{a}, {a + b})", lambda a, b: f"\\{{{a}, {b}\\}}", lambda a, b: f"\\frac{{{a}\\pi}}{{{b}}}"]


def math_by_groups(prompts, completions, **kwargs):
    """math_accuracy without its `rowwise` mark: the workers cut its calls between whole groups only."""
    return math_accuracy(prompts, completions, **kwargs)


def format_by_groups(prompts, completions, **kwargs):
    return think_format(prompts, completions, **kwargs)


def batch(prompts: int, group: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    """(prompts, completions, golds): a third of each group gives the gold answer, the rest other numbers."""
    rng = random.Random(seed)
    ps, cs, gs = [], [], []
    for p in range(prompts):
        form = FORMS[p % len(FORMS)]
        a, b = rng.randrange(2, 10**6), rng.randrange(2, 10**6)
        gold = form(a, b)
        for i in range(group):
            answer = gold if i % 3 == 0 else form(rng.randrange(2, 10**6), b)
            ps.append(f"prompt {seed}-{p}")
            cs.append(f"<think>Working it out step by step.</think>\nThe answer is $\\boxed{{{answer}}}$.")
            gs.append(gold)
    return ps, cs, gs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--whole-groups", action="store_true", help="slices of whole groups only (the functions "
                    "unmarked), as for a function that compares a completion with its group")
    args = ap.parse_args()
    funcs = [math_by_groups, format_by_groups] if args.whole_groups else [math_accuracy, think_format]
    start = {}
    pools = {}
    for n in args.workers:
        t = time.perf_counter()
        pools[n] = RewardWorkers(n, funcs)
        start[n] = time.perf_counter() - t
    sides = [0] + args.workers
    times: dict[int, list[float]] = {n: [] for n in sides}
    seed = 0
    for side in sides:  # warm-up: math-verify's and sympy's imports and first calls, everywhere
        ps, cs, gs = batch(2, args.group, seed := seed + 1)
        score_completions(funcs, None, ps, cs, {"answer": gs}, workers=pools.get(side), group_size=args.group)
    for _ in range(args.rounds):
        for side in sides:  # alternated; each call on numbers no earlier call saw
            ps, cs, gs = batch(args.prompts, args.group, seed := seed + 1)
            ref = score_completions(funcs, None, ps, cs, {"answer": gs}) if side else None
            t = time.perf_counter()
            out = score_completions(funcs, None, ps, cs, {"answer": gs}, workers=pools.get(side),
                                    group_size=args.group)
            times[side].append(time.perf_counter() - t)
            if ref is not None:
                assert torch.equal(ref.total, out.total), "workers scored differently"
    for pool in pools.values():
        pool.close()
    n = args.prompts * args.group
    base = statistics.median(times[0])
    print(f"{n} completions ({args.prompts} x {args.group}), {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
          f"medians of {args.rounds} alternated rounds; slices {'of whole groups' if args.whole_groups else 'of rows'}")
    for side in sides:
        med = statistics.median(times[side])
        label = "in the trainer's process" if side == 0 else f"{side} worker(s) (started in {start[side]:.1f} s)"
        runs = ", ".join(f"{x * 1000:.0f}" for x in times[side])
        print(f"  {label:<40} {med * 1000:8.1f} ms ({runs}); {med / n * 1000:.2f} ms a completion; "
              f"{base / med:.2f}x")


if __name__ == "__main__":
    main()
