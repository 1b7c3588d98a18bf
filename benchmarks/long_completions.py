"""Long completions: peak memory and time of a GRPO step as completions grow, grouprl and TRL.

    python scripts/fetch_smollm2.py models/smollm2                                   # once
    python benchmarks/long_completions.py --model models/smollm2 --lengths 256 1024  # real steps
    python benchmarks/long_completions.py --model models/smollm2 --update-only --lengths 4096 --rows 4
    python benchmarks/long_completions.py --model models/smollm2 --update-only --lengths mixed \\
        --set padding_free=false                                                     # the padded path
    python benchmarks/long_completions.py --model models/smollm2 --side trl --lengths 256

The workload: SmolLM2-135M-Instruct (the folder scripts/fetch_smollm2.py writes) on
`builtin:chat_arithmetic` prompts, `--rows` completions per step (default 16: 2 prompts x G = 8),
every completion exactly L tokens (`ignore_eos`; TRL: `min_new_tokens`), `mixed`: lengths drawn
uniformly from 50 to 4,096 (`mixed:M`: to M; seeded, the same in every run). Everything else at
each side's defaults (beta 0.04, grouprl's grpo preset, on both), `--set key=value` overriding
grouprl's config. TRL runs its defaults otherwise: gradient checkpointing on, micro-batches of 8 rows
accumulated to `--rows`.

Each measurement runs in its own process, so its peak RSS (ru_maxrss, which includes loading the
model and the optimizer state) is its own. A real step (default) reports the step's stages:
generate, log-probs (reference / old policy, when the defaults compute them), update.
`--update-only` skips generation: the rollout is random tokens of the given lengths (the update's
cost does not depend on which tokens they are), and only `Trainer.update` runs -- the way to
measure 16 x 4k on a 2-core CPU, where generating them takes an hour. Peak memory is set by the
largest single pass (micro-batches run one after another), so `--rows 4` at 4k shows the same
peak as 16 rows; its time is per step of those rows.

Last line of each run: a JSON object with the figures (also appended to --out when given).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MIXED = (50, 4096)


def lengths_of(spec: str, rows: int, seed: int = 0) -> list[int]:
    """`L`: every row L tokens; `mixed`: uniform in MIXED; `mixed:M`: uniform in 50..M (seeded)."""
    if spec.startswith("mixed"):
        rng = random.Random(seed)
        low, high = MIXED if spec == "mixed" else (MIXED[0], int(spec.split(":")[1]))
        return [rng.randint(low, high) for _ in range(rows)]
    return [int(spec)] * rows


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def parse_sets(pairs: list[str]) -> dict:
    import yaml

    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def worker_grouprl(model: str, spec: str, rows: int, update_only: bool, overrides: dict, threads: int,
                   train_data: str) -> dict:
    import torch

    from grouprl.batch import StepBatch
    from grouprl.config import TrainConfig
    from grouprl.rollout.types import sampled_rollout
    from grouprl.timings import Timings
    from grouprl.trainer import Trainer

    lengths = lengths_of(spec, rows)
    G = 8 if rows % 8 == 0 else rows
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(model=model, train_data=train_data,
                          reward_funcs=["math_accuracy", "grouprl.tasks.chat_arithmetic:boxed_accuracy"],
                          num_generations=G, prompts_per_step=rows // G, max_completion_length=max(lengths),
                          ignore_eos=True, output_dir=out, progress=False, report_to=[],
                          num_threads=threads, seed=0, **{"micro_batch_size": min(16, rows), **overrides})
        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        if not update_only:
            metrics = trainer.train_step()
            timings = {k.removeprefix("time/"): round(v, 2) for k, v in metrics.items() if k.startswith("time/")}
        else:
            prompts = trainer.prompts(trainer.train_ds.select(range(rows // G)))
            g = torch.Generator().manual_seed(0)
            V = len(trainer.tokenizer)
            tokens = [torch.randint(V // 4, V, (n,), generator=g).tolist() for n in lengths]
            rollout = sampled_rollout(prompts.prompt_ids, G, tokens, [[0.0] * n for n in lengths], max(lengths),
                                      tuple(), trainer.tokenizer.pad_token_id, ignore_eos=True)
            batch = StepBatch(rollout, [prompts.prompts[i // G] for i in range(rows)], [""] * rows,
                              torch.zeros(rows), {}, {})
            timings = Timings()
            trainer.update(batch, torch.randn(rows, generator=g), timings)
            timings = {k.removeprefix("time/"): round(v, 2) for k, v in timings.items()}
        seconds = time.perf_counter() - t0
    return {"side": "grouprl", "lengths": spec, "rows": rows, "update_only": update_only, "set": overrides,
            "seconds": round(seconds, 2), "stages": timings, "peak_rss_gib": round(peak_rss_mib() / 1024, 2),
            "tokens": sum(lengths)}


def worker_trl(model: str, spec: str, rows: int, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from grouprl.rewards import resolve_reward_func
    from grouprl.tasks.chat_arithmetic import train_rows

    torch.set_num_threads(threads)
    L = max(lengths_of(spec, rows))
    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    funcs = [resolve_reward_func(n) for n in ("math_accuracy", "grouprl.tasks.chat_arithmetic:boxed_accuracy")]
    with tempfile.TemporaryDirectory() as out:
        # TRL's default micro-batch (8 rows) accumulated to `rows` completions per step; beta as grouprl's grpo
        args = GRPOConfig(output_dir=out, num_generations=8, per_device_train_batch_size=8,
                          gradient_accumulation_steps=rows // 8, beta=0.04, max_completion_length=L, use_cpu=True,
                          max_steps=1,
                          save_strategy="no", report_to="none", disable_tqdm=True, seed=0, logging_steps=1,
                          generation_kwargs={"min_new_tokens": L})
        trainer = GRPOTrainer(model=policy, reward_funcs=funcs, args=args, processing_class=tok,
                              train_dataset=Dataset.from_list(train_rows()[:64]))
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    return {"side": "trl", "lengths": spec, "rows": rows, "update_only": False,
            "gradient_checkpointing": args.gradient_checkpointing, "seconds": round(seconds, 2),
            "peak_rss_gib": round(peak_rss_mib() / 1024, 2), "tokens": L * rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2", help="SmolLM2 folder (scripts/fetch_smollm2.py)")
    ap.add_argument("--lengths", nargs="+", default=["256", "1024", "2048", "4096", "mixed"],
                    help="completion lengths, 'mixed' (50..4096) or 'mixed:M' (50..M)")
    ap.add_argument("--rows", type=int, default=16, help="completions per step")
    ap.add_argument("--side", choices=["grouprl", "trl"], default="grouprl")
    ap.add_argument("--update-only", action="store_true", help="random tokens instead of generation (grouprl)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="grouprl config override")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--train-data", default="builtin:chat_arithmetic/train", help="grouprl's prompts")
    ap.add_argument("--out", help="append each result as a JSON line to this file")
    ap.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # one measurement in this process
        spec = args.worker[0]
        if args.side == "trl":
            result = worker_trl(args.model, spec, args.rows, args.threads)
        else:
            result = worker_grouprl(args.model, spec, args.rows, args.update_only, parse_sets(args.set),
                                    args.threads, args.train_data)
        print(json.dumps(result))
        return
    for spec in args.lengths:
        cmd = [sys.executable, __file__, "--worker", spec] + [a for a in sys.argv[1:] if a != "--worker"]
        cmd = _without_lengths(cmd)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not line.startswith("{"):
            result = {"lengths": spec, "error": f"exit {proc.returncode}: " + proc.stderr.strip()[-400:]}
        else:
            result = json.loads(line)
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")


def _without_lengths(cmd: list[str]) -> list[str]:
    """The command line for one worker: the --lengths list dropped (the worker has its own)."""
    out, skip = [], False
    for c in cmd:
        if c == "--lengths":
            skip = True
            continue
        if skip and not c.startswith("--"):
            continue
        skip = False
        out.append(c)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
