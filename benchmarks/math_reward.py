"""The math reward's cost per completion when answers need math-verify's LaTeX parser: each text
parsed afresh (what every call paid before its parses were remembered) against parses remembered
across a batch, as the trainer now calls it. A MATH-style batch: G completions per prompt whose
answers are LaTeX fractions, scored against a LaTeX gold.

    python benchmarks/math_reward.py                  # 8 prompts x 8 completions, 5 repetitions
    python benchmarks/math_reward.py --prompts 16 --group 16
"""

from __future__ import annotations

import argparse
import statistics
import time

from grouprl.rewards import math as m


def batch(prompts: int, group: int) -> list[tuple[str, str]]:
    """(completion, gold) pairs: prompt p's gold is (p+1)/(p+2); a group's answers take 3 values."""
    rows = []
    for p in range(prompts):
        gold = f"\\frac{{{p + 1}}}{{{p + 2}}}"
        for i in range(group):
            rows.append((f"Working it out step by step. The answer is $\\frac{{{p + 1 + i % 3}}}{{{p + 2}}}$.", gold))
    return rows


def score(rows: list[tuple[str, str]], fresh: bool) -> float:
    """Seconds to score `rows`; `fresh`: forget every parse before each completion."""
    m._mv_parse_cached.cache_clear()
    t = time.perf_counter()
    for completion, gold in rows:
        if fresh:
            m._mv_parse_cached.cache_clear()
        m.verify_math(completion, gold)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = batch(args.prompts, args.group)
    m.verify_math(*rows[0])  # math-verify's imports, outside the timing
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.reps):  # alternated
        for fresh in (True, False):
            times[fresh].append(score(rows, fresh))
    fresh, kept = (statistics.median(times[k]) * 1000 for k in (True, False))
    n = len(rows)
    print(f"{n} completions: parsed afresh {fresh:.1f} ms ({fresh / n:.2f} ms each), remembered {kept:.1f} ms "
          f"({kept / n:.2f} ms each): {fresh / kept:.1f}x (medians of {args.reps})")


if __name__ == "__main__":
    main()
