"""The kernels one decode step launches, counted on the meta device at SmolLM2's GPU shapes.

    python benchmarks/decode_launches.py                      # 135M and 1.7B shapes, sampled and greedy
    python benchmarks/decode_launches.py --json out.json

On a GPU a small model's decode step waits on its kernels one after another, whether Python launches
them (eager) or a CUDA graph replays them (`generation_cuda_graphs`): a graph takes the launch away,
not each kernel's own few microseconds. So the count of kernels sets the graphed eager step's
floor, and it can be counted without a GPU. The step is the slot loop's eager `decode_step`
(rollout/compiled_decode.py) on a decoder built from a random-init Llama of the shape on meta (no
weights are allocated), with bf16 matmuls over fp32 weights, 16 rows and 64 attended columns, as on
CUDA. The count is the top-level aten ops it dispatches, views left out (a view launches nothing):
each is a kernel on CUDA, a few two (baddbmm copies its broadcast bias into the output first).
`F.rms_norm` counts as one: on CUDA torch runs it as one fused kernel, where CPU and meta split it into six.
Layers: the count with two layers less the count with one, and the step's ops outside them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import vs_trl  # noqa: E402
from grouprl.rollout import compiled_decode as cd  # noqa: E402
from grouprl.rollout import sampling  # noqa: E402
from grouprl.rollout.llama_decoder import FastDecoder  # noqa: E402

META = torch.device("meta")
VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "slice", "select", "narrow", "unsqueeze", "squeeze",
         "expand", "detach", "as_strided", "alias", "permute", "split", "split_with_sizes", "chunk", "unbind"}
ROWS, WIDTH = 16, 64


class Kernels(TorchDispatchMode):
    """Counts the non-view top-level ops dispatched, by name; inside `F.rms_norm` nothing (counted once
    by `FusedRmsNorm`)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class FusedRmsNorm(TorchFunctionMode):
    def __init__(self, kernels: Kernels):
        super().__init__()
        self.kernels = kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.rms_norm:
            return func(*args, **(kwargs or {}))
        self.kernels.ops["rms_norm"] += 1
        self.kernels.paused = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.kernels.paused = False


def step_ops(shape: dict, layers: int, greedy: bool) -> collections.Counter:
    """The kernels of one decode step of `shape` with `layers` layers."""
    cfg = LlamaConfig(**{**shape, "num_hidden_layers": layers})
    with META:
        model = LlamaForCausalLM(cfg).eval()
    dec = FastDecoder(model, dtype=torch.bfloat16)
    ids = torch.zeros(ROWS // 8, 16, dtype=torch.long, device=META)
    with torch.no_grad():
        dec.start(ids, torch.ones_like(ids), 8, WIDTH, zeroed=True)
    S = ROWS
    spec = cd.StepSpec(greedy, 1.0 if greedy else 0.7, 0 if greedy else 50, 1.0 if greedy else 0.9, 0, True)
    longs = [torch.zeros(n, dtype=torch.long, device=META) for n in (S, S, 2, S)]
    args = (dec, spec, longs[0], longs[1], longs[2], longs[3], torch.zeros(S, dtype=torch.bool, device=META),
            torch.empty(WIDTH - 1, dtype=torch.bool, device=META), dec.valid, dec.k, dec.v,
            torch.zeros(S + 1, WIDTH, dtype=torch.float64, device=META),
            torch.zeros(S + 1, WIDTH, dtype=torch.long, device=META), torch.zeros(2, dtype=torch.long, device=META),
            torch.full((S + 1,), WIDTH, dtype=torch.long, device=META))
    kernels = Kernels()
    with torch.no_grad(), kernels, FusedRmsNorm(kernels):
        cd.decode_step(*args)
    return kernels.ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=sorted(vs_trl.SHAPES), choices=sorted(vs_trl.SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sampling.SCAN_BLOCK["meta"] = sampling.SCAN_BLOCK["cuda"]  # the running sum as CUDA takes it
    rows = []
    print("| shape | draw | kernels per layer | outside the layers | per step |\n|---|---|---|---|---|")
    for name in args.shapes:
        shape = vs_trl.SHAPES[name]
        for greedy in (False, True):
            one, two = step_ops(shape, 1, greedy), step_ops(shape, 2, greedy)
            layer = two - one
            outside = one - layer
            per_layer, rest = sum(layer.values()), sum(outside.values())
            total = rest + per_layer * shape["num_hidden_layers"]
            rows.append({"shape": name, "greedy": greedy, "per_layer": per_layer, "outside": rest, "per_step": total,
                         "layer_ops": dict(layer.most_common()), "outside_ops": dict(outside.most_common())})
            print(f"| {name} | {'greedy' if greedy else 'sampled'} | {per_layer} | {rest} | {total} |")
    print("\nper layer:", ", ".join(f"{k} {v}" for k, v in rows[0]["layer_ops"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
