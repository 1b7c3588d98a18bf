"""Milliseconds per decode token of the built-in engine, eager against the compiled step
(`generation_compile`, rollout/compiled_decode.py), with the compile time reported apart.

    python benchmarks/decode.py                                   # every model, rows and prompt length
    python benchmarks/decode.py --models tiny 50m --rows 16 --prompt 16
    python benchmarks/decode.py --models smollm2 --smollm2 models/smollm2 --dtypes fp32 bf16
    python benchmarks/decode.py --device cuda --models smollm2-135m-shape smollm2-1.7b-shape --rows 16
    python benchmarks/decode.py --device cuda --cuda-graphs off ...     # without the CUDA-graph columns
    python benchmarks/decode.py --models qwen3-0.6b-shape --rows 16 --prompt 16 --generic  # and the generic path

Models: the random-init `tiny`, `10m` and `50m` Qwen2 workloads (grouprl.tasks.testing), the real
SmolLM2-135M-Instruct (`smollm2`, the folder scripts/fetch_smollm2.py writes), and random-init
Llamas of SmolLM2's 135M and 1.7B shapes (`smollm2-*-shape`, benchmarks/vs_trl.py's SHAPES), and a
random-init Qwen3 of Qwen3-0.6B's shape (`qwen3-0.6b-shape`: 28 layers, hidden 1,024, 16 query heads
of 128 on 8 key/value heads, its 151,936-token vocabulary; SmolLM2's tokenizer gives only the pad and
EOS ids). bf16 runs only where the device multiplies it natively. `--generic` adds a side that decodes
through the model's own forward with transformers' cache (`HFEngine(fast=False)`): what a model the
fast decoder does not take gets, and what Qwen3, Mistral and SmolLM3 models got before it took them.

A cell is one model, dtype, row count R and prompt length P: R rows (R/8 prompts x 8 completions,
or 1 x R below 8) of P random prompt tokens decode `--tokens` new tokens with ignore_eos. The
decode time of a call is its whole time less that of the same call with one new token (prefill
and the first draw), over tokens - 1 steps. Each cell alternates eager and compiled calls for
`--reps` rounds after one warm-up call each (the compiled side's warm-up compiles: the first cell
of a model reports the compile time; later cells reuse the graph) and reports medians; the
engine's own thread policy applies (one thread for models up to 5 M parameters on CPU). On CUDA two
more sides join the rotation (`--cuda-graphs off` leaves them out): the eager and the compiled step
replayed as captured CUDA graphs (`generation_cuda_graphs`). In the JSON, `graphs_failed` names the
reason if capturing failed and those sides fell back to launching kernels, `compile_failed` the
reason if the compiled sides ran the eager step, and `captures_per_call` how many shapes a graphed
side's full-length call captured (each costs a direct step and a capture: `--graph-width-step`
sets how often the attended width makes a new one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def build(name: str, smollm2: str, device: str):
    from grouprl.tasks.testing import TINY_SIZES, build_tiny_model

    if name in TINY_SIZES:
        model, tok = build_tiny_model(name, seed=0)
        return model.to(device).eval(), tok.pad_token_id, tok.eos_token_id, len(tok)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(smollm2)
    if name == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    elif name in QWEN3_SHAPES:
        from transformers import Qwen3Config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_SHAPES[name]), dtype=torch.float32)
    else:
        from vs_trl import SHAPES

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[name]), dtype=torch.float32)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model.to(device).eval(), pad, tok.eos_token_id, model.config.vocab_size


QWEN3_SHAPES = {"qwen3-0.6b-shape": dict(
    vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40_960)}


def native_bf16(device: str) -> bool:
    from grouprl.precision import native_bf16 as native

    return native(torch.device(device))[0]


def cell(model, pad, eos, vocab, rows: int, prompt: int, tokens: int, reps: int, dtype, device: str,
         threads: int | None = None, cuda_graphs: bool = True, compile: bool = True, generic: bool = False) -> dict:
    from grouprl.rollout import HFEngine, SamplingParams
    from grouprl.rollout import compiled_decode as cd

    G = min(8, rows)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (rows // G, prompt), generator=gen).tolist()
    variants = {"eager": dict(compile=False, cuda_graphs=False)}
    if generic:  # the model's own forward, transformers' cache: no fast decoder
        variants["generic"] = dict(compile=False, cuda_graphs=False, fast=False)
    if device == "cuda" and cuda_graphs:  # the eager step replayed as captured CUDA graphs
        variants["eager_graphs"] = dict(compile=False, cuda_graphs=True)
    if compile:
        variants["compiled"] = dict(compile=True, cuda_graphs=False)
        if device == "cuda" and cuda_graphs:  # the compiled step replayed as captured CUDA graphs
            variants["graphs"] = dict(compile=True, cuda_graphs=True)
    engines = {v: HFEngine(model, (eos,), pad, autocast_dtype=dtype, decode_threads=threads, **kw)
               for v, kw in variants.items()}

    captures = {v: 0 for v in variants}  # graphs captured by a side's last full-length call

    def timed(variant: str, n: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        before = CAPTURES[0]
        start = time.perf_counter()
        engines[variant].generate(prompts, G, SamplingParams(n, ignore_eos=True), torch.Generator().manual_seed(1))
        if device == "cuda":
            torch.cuda.synchronize()
        if n == tokens:
            captures[variant] = CAPTURES[0] - before
        return time.perf_counter() - start

    before = cd.compile_seconds(torch.device(device).type)
    warm = {v: timed(v, tokens) for v in variants}
    after = cd.compile_seconds(torch.device(device).type)
    per_token = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            full, one = timed(v, tokens), timed(v, 1)
            per_token[v].append((full - one) / (tokens - 1) * 1e3)
    ms = {v: statistics.median(runs) for v, runs in per_token.items()}
    out = {"rows": rows, "prompt": prompt, "first_call_s": {v: round(x, 2) for v, x in warm.items()}}
    for v in variants:  # <side>_ms, <side>_runs, and each other side's speed-up over eager
        out[f"{v}_ms"] = round(ms[v], 3)
        out[f"{v}_runs"] = [round(x, 3) for x in per_token[v]]
        if v != "eager":
            out["speedup" if v == "compiled" else f"{v}_speedup"] = round(ms["eager"] / ms[v], 2)  # generic: < 1
    if compile:
        out["compile_s"] = round(after, 1) if before is None and after is not None else None
        # a reason when compiling failed: the "compiled" (and "graphs") runs then decoded without compiling
        out["compile_failed"] = cd._FAILED.get(torch.device(device).type)
    if "eager_graphs" in variants:  # a reason: the graphed runs launched kernels one by one
        out["graphs_failed"] = cd._GRAPHS_FAILED.get("cuda")
        out["captures_per_call"] = {v: captures[v] for v in variants if variants[v]["cuda_graphs"]}
        out["graph_width_step"] = cd.GRAPH_WIDTH_STEP
    return out


CAPTURES = [0]  # graphs captured in this process (counted around CompiledDecodeLoop._capture)


def count_captures() -> None:
    from grouprl.rollout import compiled_decode as cd

    capture = cd.CompiledDecodeLoop._capture

    def counted(self, *args):
        CAPTURES[0] += 1
        return capture(self, *args)

    cd.CompiledDecodeLoop._capture = counted


def main() -> None:
    import logging

    # a compile that fails: its whole traceback (the run's warning names the error only)
    compile_log = logging.getLogger("grouprl.rollout.compiled_decode")
    compile_log.addHandler(logging.StreamHandler())
    compile_log.setLevel(logging.DEBUG)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "10m", "50m", "smollm2"])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 64])
    ap.add_argument("--prompt", nargs="+", type=int, default=[16, 512])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per call (default 64)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smollm2", default="models/smollm2")
    ap.add_argument("--json", default=None, help="write the results here as well")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads while decoding (default: the engine's policy)")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the compiled sides: eager, and on CUDA eager replayed as graphs (no compile wait)")
    ap.add_argument("--generic", action="store_true",
                    help="also time the generic path (the model's own forward; HFEngine(fast=False))")
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                    help="on CUDA, also time the compiled step replayed as CUDA graphs (default on)")
    ap.add_argument("--graph-width-step", type=int, default=None,
                    help="attended cache columns are bucketed by this when replaying graphs (default: "
                         "compiled_decode.GRAPH_WIDTH_STEP); each bucket is a captured shape")
    args = ap.parse_args()
    count_captures()
    if args.graph_width_step:
        from grouprl.rollout import compiled_decode as cd

        cd.GRAPH_WIDTH_STEP = args.graph_width_step
    results = []
    for name in args.models:
        model, pad, eos, vocab = build(name, args.smollm2, args.device)
        layers = model.config.num_hidden_layers
        params = sum(p.numel() for p in model.parameters())
        for dt in args.dtypes:
            if dt == "bf16" and (name in ("tiny", "10m") or not native_bf16(args.device)):
                continue  # tiny models: bf16 changes nothing that matters; elsewhere: emulated bf16
            dtype = torch.bfloat16 if dt == "bf16" else None
            from grouprl.rollout import compiled_decode as cd

            cd._COMPILE_SECONDS.clear()  # report this model's first compile, or why it failed
            cd._FAILED.clear()
            for prompt in args.prompt:
                for rows in args.rows:
                    r = cell(model, pad, eos, vocab, rows, prompt, args.tokens, args.reps, dtype, args.device,
                             args.threads, args.cuda_graphs == "on", not args.no_compile, args.generic)
                    r.update(model=name, dtype=dt, layers=layers, params=params, device=args.device,
                             threads=args.threads or "engine")
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    if args.json:  # after every cell: a run cut off by a time limit keeps the cells it finished
                        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        del model
    graphs = any("eager_graphs_ms" in r for r in results)
    generic = any("generic_ms" in r for r in results)
    extra = (" eager + CUDA graphs | speed-up | compiled + CUDA graphs | speed-up |", "---|---|---|---|") if graphs \
        else ("", "")
    gen = (" generic ms/token |", "---|") if generic else ("", "")
    print(f"\n| model | dtype | rows | prompt |{gen[0]} eager ms/token | compiled ms/token | speed-up |{extra[0]} "
          "compile s |")
    print(f"|---|---|---|---|{gen[1]}---|---|---|{extra[1]}---|")

    def x(v) -> str:  # a speed-up, or blank for a side not run
        return f"{v}x" if v is not None else ""

    for r in results:
        g = (f" {r.get('eager_graphs_ms', '')} | {x(r.get('eager_graphs_speedup'))} |"
             f" {r.get('graphs_ms', '')} | {x(r.get('graphs_speedup'))} |") if graphs else ""
        compile_s = f"failed ({r['compile_failed']})" if r.get("compile_failed") else r.get("compile_s") or ""
        gcol = f" {r.get('generic_ms', '')} |" if generic else ""
        print(f"| {r['model']} | {r['dtype']} | {r['rows']} | {r['prompt']} |{gcol} {r['eager_ms']} | "
              f"{r.get('compiled_ms', '')} | {x(r.get('speedup'))} |{g} {compile_s} |")


if __name__ == "__main__":
    main()
