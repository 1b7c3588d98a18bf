"""Weight sync to a vLLM server: in memory (vLLM's weight-transfer engine, gloo on this CPU) against
the safetensors file, for one model.

    python benchmarks/weight_transfer.py --model models/smollm2 --rounds 5   # SmolLM2-135M (README)
    python benchmarks/weight_transfer.py --rounds 3                        # a tiny model, seconds
    python benchmarks/weight_transfer.py --model models/smollm2 --lora-rank 16 --rounds 5

With `--lora-rank R` the policy is a LoRA model of rank R (all linear layers) and a third path
joins: `adapter` (vllm_lora_sync: adapter; the server is started with --lora-rank R), which sends
the base weights once (in round 0) and then only the adapter; the merged paths send W + BA. Each
path also times one generation after its sync (4 prompts x 8 samples x 64 tokens, ignore_eos),
since the adapter path samples through vLLM's LoRA kernels.

Starts one `grouprl vllm-serve` (float32, as the trainer computes), builds two engines against it
(one per path; each is a trainer's client) and alternates their `sync_weights` (gloo, file, gloo,
file, ...), changing the weights before each sync, so every sync sends new weights and the server
loads them. Each sync is timed from the call until the server holds the weights (the file path:
write, load, delete; gloo: stream the buckets, load, finish), and the server's log-probs are checked
against the trainer's after the last one. Prints the median, min and max per path, the bytes each
sync moves, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder (default: a tiny test model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=18566)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the result as one JSON line")
    args = ap.parse_args()

    import torch

    from benchmarks.async_rollouts import start_server
    from grouprl.policy import load_policy, load_tokenizer
    from grouprl.rollout import SamplingParams
    from grouprl.rollout.vllm_server import VLLMServerEngine
    from grouprl.tasks.testing import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(save_tiny_model(Path(tmp) / "tiny", "tiny", seed=0))
        lora = ("--lora-rank", str(args.lora_rank)) if args.lora_rank else ()
        server = start_server(model_dir, args.port, Path(tmp) / "server.log", lora)
        try:
            tok = load_tokenizer(model_dir)
            model = load_policy(model_dir, lora_r=args.lora_rank, lora_alpha=2 * args.lora_rank)
            kwargs = dict(eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                          weight_dir=str(Path(tmp) / "w"), timeout_s=600, transfer_bucket_bytes=args.bucket_mb << 20)
            engines = {p: VLLMServerEngine("127.0.0.1", args.port, weight_transfer=p, **kwargs)
                       for p in ("gloo", "file")}
            if args.lora_rank:
                # its base weights (once) by file: a server joins one trainer's transfer group at a time
                engines["adapter"] = VLLMServerEngine("127.0.0.1", args.port, lora_rank=args.lora_rank,
                                                      weight_transfer="file", **kwargs)
            times: dict[str, list[float]] = {p: [] for p in engines}
            gen: dict[str, list[float]] = {p: [] for p in engines}
            prompts = [tok(f"What is {a}+{a + 7}? ")["input_ids"] for a in range(4)]
            params = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True)
            trainable = [p for p in model.parameters() if p.requires_grad]
            version = 0
            # the merged paths alternate; the adapter path runs after them, on its own: it expects the
            # server's base weights to be the base model's, which each merged sync overwrites (its
            # first sync sends them back). Round 0 warms every path up (the gloo group joins there).
            phases = [[p for p in engines if p != "adapter"]] + ([["adapter"]] if "adapter" in engines else [])
            for r, path in ((r, path) for phase in phases for r in range(args.rounds + 1) for path in phase):
                engine = engines[path]
                with torch.no_grad():
                    for p in trainable:
                        p.add_(1e-3)  # LoRA's B starts at 0: this makes every adapter count
                version += 1
                t0 = time.perf_counter()
                engine.sync_weights(model, version)
                t1 = time.perf_counter()
                engine.generate(prompts, 8, params, torch.Generator().manual_seed(r))
                if r:
                    times[path].append(t1 - t0)
                    gen[path].append(time.perf_counter() - t1)
            from grouprl.engine_check import max_logprob_gap

            last = list(engines)[-1]  # synced last: it holds the newest weights
            gap = max_logprob_gap(engines[last], model, [tok("What is 2+3?")["input_ids"]])
            # the newest adapter's files (the engine keeps the last two on the server, for requests in flight)
            adapters = sorted((Path(tmp) / "w").glob("adapter-*"), key=lambda d: d.stat().st_mtime)
            adapter_bytes = sum(f.stat().st_size for f in adapters[-1].rglob("*.safetensors")) if adapters else 0
            for engine in engines.values():
                engine.close()
        finally:
            os.killpg(server.pid, 9)
            server.wait()
    from grouprl.lora import merged_weight_meta

    nbytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=d).element_size()
                 for _, d, shape in merged_weight_meta(model))
    med = {p: statistics.median(t) for p, t in times.items()}
    gmed = {p: statistics.median(t) for p, t in gen.items()}
    result = {"model": args.model or "tiny", "bytes": nbytes, "rounds": args.rounds, "bucket_mb": args.bucket_mb,
              "lora_rank": args.lora_rank, "adapter_bytes": adapter_bytes if args.lora_rank else None,
              "load_1min": round(os.getloadavg()[0], 2), "logp_gap_after": gap,
              **{f"{p}_s": [round(x, 4) for x in t] for p, t in times.items()},
              **{f"{p}_median_s": round(m, 4) for p, m in med.items()},
              **{f"{p}_generate_median_s": round(m, 3) for p, m in gmed.items()},
              "file_over_gloo": round(med["file"] / med["gloo"], 2)}
    print(f"{result['model']}: {nbytes / 2**20:.0f} MiB merged per sync, {args.rounds} rounds, "
          f"buckets {args.bucket_mb} MiB" + (f"; adapter {adapter_bytes / 2**20:.1f} MiB" if args.lora_rank else ""))
    for p, t in times.items():
        print(f"  {p:7s} sync median {med[p]:.3f} s (min {min(t):.3f}, max {max(t):.3f}); "
              f"generation after it {gmed[p]:.2f} s")
    print(f"  file / gloo: {result['file_over_gloo']:.2f}x; server log-probs after the last sync within "
          f"{gap:.1e} of the trainer's")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
