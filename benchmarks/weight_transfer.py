"""Weight sync to a vLLM server: in memory (vLLM's weight-transfer engine, gloo on this CPU) against
the safetensors file, for one model.

    python benchmarks/weight_transfer.py --model models/smollm2 --rounds 5   # SmolLM2-135M (README)
    python benchmarks/weight_transfer.py --rounds 3                        # a tiny model, seconds

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
    ap.add_argument("--out", default=None, help="append the result as one JSON line")
    args = ap.parse_args()

    import torch

    from benchmarks.async_rollouts import start_server
    from grouprl.policy import load_policy, load_tokenizer
    from grouprl.rollout.vllm_server import VLLMServerEngine
    from grouprl.tasks.testing import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(save_tiny_model(Path(tmp) / "tiny", "tiny", seed=0))
        server = start_server(model_dir, args.port, Path(tmp) / "server.log")
        try:
            tok, model = load_tokenizer(model_dir), load_policy(model_dir)
            kwargs = dict(eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id,
                          weight_dir=str(Path(tmp) / "w"), timeout_s=600, transfer_bucket_bytes=args.bucket_mb << 20)
            engines = {p: VLLMServerEngine("127.0.0.1", args.port, weight_transfer=p, **kwargs)
                       for p in ("gloo", "file")}
            times: dict[str, list[float]] = {p: [] for p in engines}
            version = 0
            for r in range(args.rounds + 1):  # round 0 warms both paths up (the gloo group joins there)
                for path, engine in engines.items():
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.0001)
                    version += 1
                    t0 = time.perf_counter()
                    engine.sync_weights(model, version)
                    if r:
                        times[path].append(time.perf_counter() - t0)
            from tests.rollout._vllm import max_logp_gap

            gap = max_logp_gap(engines["file"], model, [tok("What is 2+3?")["input_ids"]])
            for engine in engines.values():
                engine.close()
        finally:
            os.killpg(server.pid, 9)
            server.wait()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    med = {p: statistics.median(t) for p, t in times.items()}
    result = {"model": args.model or "tiny", "bytes": nbytes, "rounds": args.rounds, "bucket_mb": args.bucket_mb,
              "load_1min": round(os.getloadavg()[0], 2), "logp_gap_after": gap,
              **{f"{p}_s": [round(x, 4) for x in t] for p, t in times.items()},
              "gloo_median_s": round(med["gloo"], 4), "file_median_s": round(med["file"], 4),
              "file_over_gloo": round(med["file"] / med["gloo"], 2)}
    print(f"{result['model']}: {nbytes / 2**20:.0f} MiB per sync, {args.rounds} rounds, buckets {args.bucket_mb} MiB")
    for p, t in times.items():
        print(f"  {p:4s} median {med[p]:.3f} s (min {min(t):.3f}, max {max(t):.3f}), "
              f"{nbytes / med[p] / 2**30:.2f} GiB/s")
    print(f"  file / gloo: {result['file_over_gloo']:.2f}x; server log-probs after the last sync within "
          f"{gap:.1e} of the trainer's")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
