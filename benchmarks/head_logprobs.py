"""What the chunked LM head saves: one forward + backward of the update's log-prob pass
(`policy.completion_logprobs` with entropy) through whole [n, T, V] logits and through the head in
chunks (core/head_logprobs.py), each in a fresh process, alternated; peak RSS and median time.

    python benchmarks/head_logprobs.py                       # SmolLM2's head: V 49152, H 576, tied
    python benchmarks/head_logprobs.py --lengths 64 512 --rows 16 --layers 2
    python benchmarks/head_logprobs.py --entropy-bonus       # the entropy differentiated too (entropy_coef > 0)

The body is a random Qwen2 of `--layers` layers with SmolLM2-135M's width and vocabulary, so the
head's share is what changes between the two arms; a real model adds the same body memory to both.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def worker(args) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import grouprl.policy as policy
    from grouprl.micro_batches import MicroBatch
    from grouprl.policy import completion_logprobs
    from grouprl.rollout import Rollout

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).train()
    n, P, T = args.rows, 32, args.length
    g = torch.Generator().manual_seed(1)
    rollout = Rollout(torch.randint(0, args.vocab, (n, P), generator=g), torch.ones(n, P, dtype=torch.long),
                      torch.randint(0, args.vocab, (n, T), generator=g), torch.ones(n, T, dtype=torch.bool),
                      torch.zeros(n, dtype=torch.bool))
    mb = MicroBatch.from_rollout(rollout, torch.arange(n))
    limit = 0 if args.arm == "chunked" else 1 << 62
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp, entropy = completion_logprobs(model, mb, temperature=1.0, with_entropy=True,
                                            entropy_grad=args.entropy_bonus, max_logits_elements=limit)  # [n, T]
        loss = logp.mean() - 0.01 * entropy.mean() if args.entropy_bonus else logp.mean()
        loss.backward()
        times.append(time.perf_counter() - t0)
    assert min(policy.WHOLE_LOGITS_MAX_ELEMENTS.values()) > 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"arm": args.arm, "length": T, "seconds": statistics.median(times),
                      "peak_mib": peak / 1024, "model_mib": base / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per process (the median is kept)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two arms per length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--entropy-bonus", action="store_true",
                    help="differentiate the entropy too, as entropy_coef > 0 does (both arms)")
    ap.add_argument("--arm", choices=["whole", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        return worker(args)
    print(f"rows {args.rows}, prompt 32, layers {args.layers}, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.threads} threads; median of {args.rounds} processes x {args.repeats} passes"
          + ("; entropy bonus (the entropy's gradient too)" if args.entropy_bonus else ""))
    print("| completion tokens | whole logits: s, peak MiB | chunked head: s, peak MiB | time ratio | peak ratio |")
    print("|---|---|---|---|---|")
    for T in args.lengths:
        runs: dict[str, list[dict]] = {"whole": [], "chunked": []}
        for r in range(args.rounds):
            for arm in ("whole", "chunked") if r % 2 == 0 else ("chunked", "whole"):
                cmd = [sys.executable, __file__, "--arm", arm, "--length", str(T)] + [
                    f"--{k}={v}" for k, v in (("rows", args.rows), ("layers", args.layers), ("vocab", args.vocab),
                                             ("hidden", args.hidden), ("repeats", args.repeats),
                                             ("threads", args.threads))] + (["--entropy-bonus"] * args.entropy_bonus)
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                runs[arm].append(json.loads(out.strip().splitlines()[-1]))
        med = {arm: {k: statistics.median(x[k] for x in v) for k in ("seconds", "peak_mib")} for arm, v in runs.items()}
        w, c = med["whole"], med["chunked"]
        print(f"| {T} | {w['seconds']:.3f}, {w['peak_mib']:.0f} | {c['seconds']:.3f}, {c['peak_mib']:.0f} | "
              f"{c['seconds'] / w['seconds']:.2f} | {c['peak_mib'] / w['peak_mib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
