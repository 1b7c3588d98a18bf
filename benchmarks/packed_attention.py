"""A packed row's attention, forward and backward, per segment against one SDPA call with the block
mask (grouprl/packing.py, `one_masked_call`): milliseconds per call at the shapes of GRPO steps,
G completions after each of a few shared prompts.

    python benchmarks/packed_attention.py                       # the shapes of benchmarks/README.md "Short packed rows"
    python benchmarks/packed_attention.py --shape 4,4,32,2,8,7,3 --reps 50

A shape is H,Hkv,D,prompts,G,P,L: query heads, key heads, head size, prompts per row, completions per
prompt, prompt and completion length. Each side runs `--reps` times after 3 warm-up calls, the two
sides alternated `--rounds` times; the figure is the fastest round's median. The last column says
which path `one_masked_call` picks for the row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from grouprl import packing

SHAPES = [  # H, Hkv, D, prompts, G, P, L
    (4, 4, 32, 16, 8, 7, 3),     # the embedded task: its step of 16 prompts x 8 ~3-token answers in one pass
    (4, 4, 32, 2, 8, 7, 3),      # the same answers, 16 rows (micro_batch_size 16)
    (4, 4, 32, 4, 8, 10, 12),
    (4, 4, 32, 2, 16, 10, 16),
    (4, 4, 32, 2, 8, 10, 28),    # tiny-32
    (4, 4, 32, 2, 8, 10, 64),
    (9, 3, 64, 2, 8, 20, 16),    # SmolLM2-135M's heads
    (9, 3, 64, 4, 8, 10, 12),
    (9, 3, 64, 2, 8, 20, 64),
]


def layout_of(prompts: int, G: int, P: int, L: int) -> packing.PackedLayout:
    """`packing.pack`'s row for `prompts` prompts of P tokens, each with G completions of L tokens."""
    n = prompts * G
    return packing.pack(torch.ones(prompts, P, dtype=torch.long), torch.ones(prompts, P, dtype=torch.long),
                        torch.arange(prompts).repeat_interleave(G), torch.ones(n, L, dtype=torch.long),
                        torch.ones(n, L, dtype=torch.bool), torch.device("cpu"))


def measure(shape: tuple[int, ...], reps: int, rounds: int) -> dict:
    H, Hkv, D, prompts, G, P, L = shape
    layout = layout_of(prompts, G, P, L)
    segments, S, mask = layout.segments, layout.num_tokens, layout.block_mask()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, S, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, Hkv, S, D, generator=g, requires_grad=True) for _ in range(2))
    upstream = torch.randn(1, S, H, D, generator=g)
    sides = {"per_segment": lambda: packing.packed_attention(q, k, v, segments, None),
             "masked": lambda: packing.masked_attention(q, k, v, mask, None)}
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, attend in sides.items():
            def call():
                (attend() * upstream).sum().backward()
            for _ in range(3):
                call()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            best[name] = min(best.get(name, float("inf")), statistics.median(times) * 1e3)
    return {"shape": shape, "tokens": S, "segments": len(segments), "work_per_segment": S * S * H * D / len(segments),
            **{f"{name}_ms": round(ms, 3) for name, ms in best.items()},
            "picked": "masked" if packing.one_masked_call(S, len(segments), H, D) else "per_segment"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="H,Hkv,D,prompts,G,P,L (repeatable; default: SHAPES)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here as well")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    rows = [measure(s, args.reps, args.rounds) for s in shapes]
    print(f"packed attention, forward + backward, fp32, {args.threads} threads; MASKED_CALL_WORK = "
          f"{packing.MASKED_CALL_WORK}\n")
    print("| H, Hkv, D | prompts x G, P, L | tokens S | segments | S^2·H·D / segment | per segment ms | masked ms "
          "| masked / per segment | picked |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        H, Hkv, D, prompts, G, P, L = r["shape"]
        print(f"| {H}, {Hkv}, {D} | {prompts} x {G}, {P}, {L} | {r['tokens']} | {r['segments']} | "
              f"{r['work_per_segment'] / 2**20:.2f} x 2^20 | {r['per_segment_ms']:.2f} | {r['masked_ms']:.2f} | "
              f"{r['masked_ms'] / r['per_segment_ms']:.2f} | {r['picked']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
