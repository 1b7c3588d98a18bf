"""What the shared-prompt forward saves: one update (forward + backward) and one reference pass
over B prompts x G completions, with `share_prompt_forward` on and off, alternated.

    python benchmarks/shared_prompt.py                                  # P=120, T=200, G=8, B=2, 10m
    python benchmarks/shared_prompt.py --prompt-len 30 --completion-len 32 --size tiny

Prompts and completions are random tokens of exactly the given lengths (GSM8K-style prompts with
a system message are ~100-200 tokens, completions a few hundred), so both settings compute on
the same batch; the figure is the median over `--repeats` alternations. Without sharing a
micro-batch runs n*(P+T) tokens; with it u*(P-1) + n*T, u being its distinct prompts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from grouprl.batch import StepBatch
from grouprl.config import TrainConfig
from grouprl.rollout import Rollout
from grouprl.tasks.testing import save_tiny_model
from grouprl.timings import Timings
from grouprl.trainer import Trainer


def random_rollout(B: int, G: int, P: int, T: int, vocab: int, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (B, P), generator=g).repeat_interleave(G, 0)  # [N, P]
    N = B * G
    return Rollout(prompts, torch.ones(N, P, dtype=torch.long), torch.randint(4, vocab, (N, T), generator=g),
                   torch.ones(N, T, dtype=torch.bool), torch.ones(N, dtype=torch.bool))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10m", help="a key of grouprl.tasks.testing.TINY_SIZES")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=120)
    ap.add_argument("--completion-len", type=int, default=200)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / args.size, args.size, seed=0)
        data = Path(tmp) / "data.jsonl"
        data.write_text('{"prompt": "x"}\n' * 4)
        trainers = {}
        for share in (False, True):  # one trainer per setting, from the same seed: the same weights
            cfg = TrainConfig(model=str(model_dir), train_data=str(data), reward_funcs=["repetition_penalty"],
                              num_generations=args.group, prompts_per_step=args.prompts,
                              micro_batch_size=args.micro_batch, max_completion_length=args.completion_len,
                              beta=0.04, output_dir=f"{tmp}/run", progress=False, report_to=[],
                              num_threads=args.threads, share_prompt_forward=share, share_prompt_min_tokens=0)
            trainers[share] = Trainer(cfg)
        vocab = trainers[False].model.config.vocab_size
        rollout = random_rollout(args.prompts, args.group, args.prompt_len, args.completion_len, vocab)
        N = len(rollout)
        batch = StepBatch(rollout, ["x"] * N, [""] * N, torch.zeros(N), {}, {})
        advantages = torch.randn(N)
        times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for r in range(args.repeats + 1):
            for share in (True, False) if r % 2 else (False, True):
                timings = Timings()
                trainers[share].update(batch, advantages, timings)  # the reference pass, then the update
                if r:  # the first round warms up
                    times[share].append((timings["time/logprobs"], timings["time/update"]))
    B, G, P, T = args.prompts, args.group, args.prompt_len, args.completion_len
    print(f"{args.size}: B={B} G={G} P={P} T={T} micro_batch={args.micro_batch}, {args.repeats} alternations")
    for share in (False, True):
        ref = statistics.median(t for t, _ in times[share])
        upd = statistics.median(u for _, u in times[share])
        print(f"  share_prompt_forward={share!s:5}: reference pass {ref:.3f} s, update {upd:.3f} s, "
              f"sum {ref + upd:.3f} s")
    off = sum(statistics.median(x[i] for x in times[False]) for i in (0, 1))
    on = sum(statistics.median(x[i] for x in times[True]) for i in (0, 1))
    per_mb = min(args.micro_batch, N)
    u = max(1, -(-per_mb // G))  # distinct prompts per micro-batch when groups stay together
    tokens_on = (N // per_mb) * (u * (P - 1) + per_mb * T)
    print(f"speed-up {off / on:.2f}x; tokens per pass {N * (P + T)} -> {tokens_on}")


if __name__ == "__main__":
    main()
