"""The ops one update dispatches, counted on CPU at a GPU workload's shape, grouprl against TRL: on a
GPU a small model's update waits on launching its kernels, not on their arithmetic, so the count
is what its time follows (issue 34: grouprl's update took 3-4x TRL's on an H200).

    python benchmarks/update_launches.py --smollm2 models/smollm2                    # gpu-135m-256's shape, 32 tokens
    python benchmarks/update_launches.py --workload gpu-1.7b-256 --sides grouprl --tokens 16

Each side trains the workload's random-init model (benchmarks/vs_trl.py, `--tokens` new tokens per
completion instead of 256: the count depends on the layers, the completions and the passes, not the
length) for two steps; the second step's update runs under torch's profiler, and the count is its
top-level aten ops (an op called by no other aten op: one dispatch, and except for views one kernel
or more on a GPU), by name. grouprl's update: forward, backward and the optimizer step (fused AdamW,
a few ops); TRL's `training_step` less its generation and scoring: forward and backward (its
optimizer step runs outside it).

grouprl runs with CUDA's defaults rather than CPU's: checkpointing every pass, the token budget
65,536 (what `auto` sizes from an H100's free memory at these shapes), `micro_batch_size: auto`'s
whole step in one pass (`--micro-batch 16`: the fixed default before it), the LM head's chunk sizes of
CUDA, and the packed passes' attention as one varlen call per layer -- a per-segment SDPA loop
wrapped so that its forward and its backward each count as one op, as torch's varlen flash kernel
is on a GPU. TRL runs its own defaults (gradient checkpointing on, one padded pass of
`per_device_train_batch_size` = 8 x prompts).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a count on the CPU: a visible GPU would take the trainer, and its backward
# would run on autograd's device thread, outside the profiled scope
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import vs_trl  # noqa: E402
from grouprl.memory import micro_batch_rows  # noqa: E402

VIEWS = {"aten::view", "aten::reshape", "aten::transpose", "aten::t", "aten::slice", "aten::select", "aten::narrow",
         "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::detach", "aten::as_strided", "aten::alias",
         "aten::permute", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unflatten",
         "aten::lift_fresh", "aten::detach_"}
ONE_KERNEL = "varlen attention (one kernel on a GPU)"


class _VarlenOnce(torch.autograd.Function):
    """Causal attention within each sequence of a packed row (cu_seqlens), forward and backward each
    inside one profiler scope, so that each counts as the one op the GPU kernel is."""

    @staticmethod
    def _attend(q, k, v, cu, scale, gqa):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1))
        return torch.cat(outs)

    @staticmethod
    def forward(ctx, q, k, v, cu, scale, gqa):
        ctx.save_for_backward(q, k, v, cu)
        ctx.scale, ctx.gqa = scale, gqa
        with record_function(ONE_KERNEL):
            return _VarlenOnce._attend(q, k, v, cu, scale, gqa)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu = ctx.saved_tensors
        half = torch.autocast("cpu", dtype=grad.dtype) if grad.dtype != torch.float32 else contextlib.nullcontext()
        with record_function(ONE_KERNEL), torch.enable_grad(), half:  # the forward ran under autocast
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            out = _VarlenOnce._attend(q, k, v, cu, ctx.scale, ctx.gqa)
            return (*torch.autograd.grad(out, (q, k, v), grad), None, None, None)


def varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's signature (torch 2.11+), causal only."""
    return _VarlenOnce.apply(q, k, v, cu_q, scale, enable_gqa)


def count(prof, stage: str, skip: tuple[str, ...] = ()) -> collections.Counter:
    """Top-level aten ops under the profiler scope `stage`, leaving out scopes named in `skip`."""
    from torch._C._profiler import _EventType

    out: collections.Counter = collections.Counter()
    stack = [(n, False, False) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, inside, in_op = stack.pop()
        name = node.name
        if name == ONE_KERNEL and inside:
            out[name] += 1
            continue
        if name in skip:
            continue
        is_op = node.typed[0] == _EventType.TorchOp and name.startswith("aten::")
        if is_op and inside and not in_op:
            out[name] += 1
        stack.extend((c, inside or name == stage, in_op or is_op) for c in node.children)
    return out


def run_grouprl(w, model_dir: str, budget: int, micro_batch: int | None = None) -> collections.Counter:
    from grouprl import packing, timings

    policy, head = importlib.import_module("grouprl.policy"), importlib.import_module("grouprl.core.head_logprobs")
    policy.WHOLE_LOGITS_MAX_ELEMENTS["cpu"] = policy.WHOLE_LOGITS_MAX_ELEMENTS["cuda"]  # CUDA's LM-head chunks
    head.HEAD_CHUNK_ELEMENTS["cpu"] = head.HEAD_CHUNK_ELEMENTS["cuda"]
    packing._varlen_kernel = varlen_kernel  # CUDA's path, one call per layer
    packing.uses_varlen = lambda *a: True
    packing.varlen_works = lambda *a: True
    settings = {"gradient_checkpointing": True, "max_tokens_per_micro_batch": budget}
    if micro_batch:
        settings["micro_batch_size"] = micro_batch
    os.environ["VS_TRL_GROUPRL_SET"] = json.dumps(settings)
    original = timings.Timings.stage
    seen = {"update": 0, "prof": None}

    @contextlib.contextmanager
    def stage(self, name):
        if name == "update":
            seen["update"] += 1
            if seen["update"] == 2:
                with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("update"), \
                        original(self, name):
                    yield
                seen["prof"] = prof
                return
        with original(self, name):
            yield

    timings.Timings.stage = stage
    try:
        vs_trl.worker_grouprl(w, model_dir, 2, torch.get_num_threads(), "cpu")
    finally:
        timings.Timings.stage = original
    return count(seen["prof"], "update")


def run_trl(w, model_dir: str) -> collections.Counter:
    import trl

    step, gen = trl.GRPOTrainer.training_step, trl.GRPOTrainer._generate_and_score_completions
    seen = {"n": 0, "prof": None}

    def training_step(self, *a, **k):
        seen["n"] += 1
        if seen["n"] != 2:
            return step(self, *a, **k)
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("update"):
            out = step(self, *a, **k)
        seen["prof"] = prof
        return out

    def generate_and_score(self, *a, **k):
        with record_function("generate and score"):
            return gen(self, *a, **k)

    trl.GRPOTrainer.training_step, trl.GRPOTrainer._generate_and_score_completions = training_step, generate_and_score
    try:
        vs_trl.worker_trl(w, model_dir, 2, torch.get_num_threads(), "cpu")
    finally:
        trl.GRPOTrainer.training_step, trl.GRPOTrainer._generate_and_score_completions = step, gen
    return count(seen["prof"], "update", skip=("generate and score",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gpu-135m-256", help="a gpu-* workload of vs_trl.py (its model shape)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per completion (default 32)")
    ap.add_argument("--sides", nargs="+", default=["grouprl", "trl"], choices=["grouprl", "trl"])
    ap.add_argument("--smollm2", default="models/smollm2", help="the tokenizer's folder (only it is read)")
    ap.add_argument("--model-config", help="a config.json replacing the workload's shape")
    ap.add_argument("--budget", type=int, default=65536, help="grouprl's max_tokens_per_micro_batch (CUDA's auto)")
    ap.add_argument("--micro-batch", type=int,
                    help="grouprl's micro_batch_size (default: CUDA's auto, the whole step on one GPU)")
    ap.add_argument("--fp32", action="store_true",
                    help="fp32 instead of the workload's bf16 (a CPU without native bf16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", help="write the counts here as well")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = replace(vs_trl.WORKLOADS[args.workload], max_tokens=args.tokens)
    if args.fp32:
        w = replace(w, bf16=False)
    shape = json.loads(Path(args.model_config).read_text()) if args.model_config else vs_trl.SHAPES[w.size]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = vs_trl.build_shape_model(Path(tmp) / "model", shape, args.smollm2, "cpu")
        for side in args.sides:
            rows = args.micro_batch or micro_batch_rows("auto", torch.device("cuda"), 8 * w.prompts, 1, args.budget)
            got = (run_grouprl(w, model_dir, args.budget, rows) if side == "grouprl"
                   else run_trl(w, model_dir))
            views = sum(n for op, n in got.items() if op in VIEWS)
            results[side] = {"ops": sum(got.values()), "views": views, "by_op": dict(got.most_common())}
    print(f"workload {w.name}'s shape, {8 * w.prompts} completions of {w.max_tokens} tokens; top-level aten ops "
          "of one update, counted on CPU")
    print("| side | ops | of which views (no kernel on a GPU) | the rest |\n|---|---|---|---|")
    for side, r in results.items():
        print(f"| {side} | {r['ops']} | {r['views']} | {r['ops'] - r['views']} |")
    for side, r in results.items():
        print(f"\n{side}: " + ", ".join(f"{op.removeprefix('aten::')} {n}"
                                        for op, n in list(r["by_op"].items())[:args.top]))
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": w.name, "tokens": args.tokens, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
