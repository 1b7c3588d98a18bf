"""How often the slot loop should look at its rows' finished flags (`HFEngine.check_every`).

The slot loop of rollout/compiled_decode.py keeps a finished row in its slot, drawing padding,
until the host next reads the flags; then, if at most half the slots are live, it moves the live
rows into fewer slots. Looking often moves finished rows out sooner, so fewer slots are computed;
each look is a read of device memory (on a GPU a sync, which drains the queue of replayed graphs)
and each move a new shape (on a GPU a new capture). Issue 36 asked for the interval to be chosen by
measurement; this measures it.

Rows must finish at different steps, so completions stop on a random `--stop-share` of the
vocabulary (a random-init model draws from a near-flat distribution: a row then ends after about
1 / share tokens, geometrically spread), sampled at temperature 1, at most `--tokens` tokens. Each
side is one `check_every`, in the slot loop (compiled on CPU by default; on CUDA the eager step
replayed as graphs unless `--compile`), and `eager-loop` is the plain eager loop, which removes a
row the step it finishes. The sides alternate for `--reps` rounds after one warm-up call each
(which compiles); each figure is the median whole-call time, with each side's completions' mean
and longest lengths. The draws depend on the seed, row and step only, so in fp32 the lengths are the
same on every side; in bf16 on a GPU they were not (an H100, 135M shape: the logits' rounding depends
on the kernels, which change with the rows a step computes), and each side's lengths say how far.

    python benchmarks/check_every.py --model tiny --rows 16 --tokens 128
    python benchmarks/check_every.py --device cuda --model smollm2-135m-shape --smollm2 models/smollm2 --rows 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, 10m, 50m, smollm2 or a smollm2-*-shape (decode.py's)")
    ap.add_argument("--smollm2", default="models/smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=16, help="completions a call (8 per prompt)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stop-share", type=float, default=1 / 32, help="share of the vocabulary that ends a row")
    ap.add_argument("--every", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", choices=["true", "false"], default=None,
                    help="the slot loop's step compiled (default: true on CPU, false on CUDA, where graphs replay it)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from decode import build

    from grouprl.rollout import HFEngine, SamplingParams

    cuda = args.device.startswith("cuda")
    compile = (args.compile or ("false" if cuda else "true")) == "true"
    model, pad, _, vocab = build(args.model, args.smollm2, args.device)
    gen = torch.Generator().manual_seed(0)
    stops = torch.randperm(vocab - 4, generator=gen)[: max(1, round(args.stop_share * vocab))] + 4
    G = min(8, args.rows)
    prompts = torch.randint(4, vocab, (args.rows // G, args.prompt), generator=gen).tolist()
    params = SamplingParams(args.tokens, temperature=1.0)
    dtype = torch.bfloat16 if args.bf16 else None
    sides = {f"every-{k}": HFEngine(model, tuple(stops.tolist()), pad, autocast_dtype=dtype, compile=compile,
                                    cuda_graphs=cuda, check_every=k) for k in args.every}
    sides["eager-loop"] = HFEngine(model, tuple(stops.tolist()), pad, autocast_dtype=dtype, compile=False,
                                   cuda_graphs=False)

    def timed(engine) -> tuple[float, torch.Tensor]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, G, params, torch.Generator().manual_seed(1))
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, out.completion_mask.sum(-1)

    lengths = {name: timed(engine)[1] for name, engine in sides.items()}  # warm-up (compiles)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.reps):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            times[name].append(timed(sides[name])[0])
    first = next(iter(lengths.values()))
    same = all(torch.equal(x, first) for x in lengths.values())
    shape = {name: {"length_mean": round(float(x.float().mean()), 2), "length_max": int(x.max())}
             for name, x in lengths.items()}
    print(f"{args.model} on {args.device}, {args.rows} rows, prompt {args.prompt}, at most {args.tokens} tokens, "
          f"{len(stops)} stop tokens: length mean {first.float().mean():.1f}, longest {int(first.max())}; "
          f"same lengths on every side: {same}")
    base = statistics.median(times["eager-loop"])
    result = {"model": args.model, "device": args.device, "rows": args.rows, "prompt": args.prompt,
              "tokens": args.tokens, "compile": compile, "length_mean": round(float(first.float().mean()), 2),
              "length_max": int(first.max()), "same_lengths": same, "sides": {}}
    for name, runs in times.items():
        med = statistics.median(runs)
        result["sides"][name] = {"s": round(med, 4), "runs": [round(x, 4) for x in runs], **shape[name]}
        mean, longest = shape[name]["length_mean"], shape[name]["length_max"]
        lengths_note = "" if same else f"  lengths mean {mean:.1f}, longest {longest}"
        print(f"  {name:>10}: {med * 1e3:8.1f} ms a call ({med / base:.2f}x the eager loop)  "
              f"runs {' '.join(f'{x * 1e3:.1f}' for x in runs)}{lengths_note}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
