"""Step time of the SmolLM2-135M-Instruct workload, stage by stage, against a matmul peak.

    python scripts/fetch_smollm2.py models/smollm2            # once
    python benchmarks/smollm2_step.py --model models/smollm2 --steps 4
    python benchmarks/smollm2_step.py --model models/smollm2 --set bf16=false --set lora_r=16
    python benchmarks/smollm2_step.py --model models/smollm2 --profile prof.txt

The workload is examples/smollm2_chat_arithmetic.yaml's: chat prompts from
`builtin:chat_arithmetic/train`, G = 8, 2 prompts per step, 64 completion tokens (natural
stopping; `--set ignore_eos=true` for fixed length), full fine-tuning, beta 0. The first step
is a warm-up and is not counted; the figures are medians over the other steps of the trainer's
own timings (time/generate, time/logprobs, time/update, ...). Last line: `s_per_step=...`.

Utilisation: the useful FLOPs of a step (vs_trl.model_flops: each prompt once per group, each
completion token once; 2 per weight per token generated, 6 per token updated) divided by the step
time, against the best fp32 and bf16 matmul FLOP/s measured in the same process with the same
thread count, before and after the steps (on a shared machine the better reading is the truer).
`--profile FILE` also runs one more step under torch.profiler and writes its top operators.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_trl import matmul_peak, model_flops  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_chat_arithmetic.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the converted SmolLM2 folder (scripts/fetch_smollm2.py)")
    ap.add_argument("--steps", type=int, default=4, help="steps after the warm-up step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a config field (YAML value), e.g. bf16=false")
    ap.add_argument("--profile", help="write torch.profiler's operator table of one extra step here")
    args = ap.parse_args()

    import torch
    import yaml

    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    torch.set_num_threads(args.threads)
    peak = matmul_peak(args.threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig.load(EXAMPLE)
        fields = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
        cfg = replace(cfg, model=args.model, output_dir=out, progress=False, report_to=[],
                      num_logged_samples=0, num_threads=args.threads, eval_data=None,
                      max_steps=args.steps + 2, **fields)
        trainer = Trainer(cfg)
        bf16 = trainer.autocast is not None
        print(f"bf16={trainer.autocast is not None} attn={trainer.model.config._attn_implementation} "
              f"micro_batch_size={cfg.micro_batch_size} lora_r={cfg.lora_r} load {os.getloadavg()[0]:.2f}",
              flush=True)
        rows, flops = [], []
        n_prompt = len(trainer.prompts(trainer.train_ds.select([0])).prompt_ids[0])
        for i in range(args.steps + 1):
            m = trainer.train_step()
            times = {k.removeprefix("time/"): v for k, v in m.items() if k.startswith("time/")}
            print(f"step {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
                  + f", length {m['completion/length_mean']:.1f}, reward {m['reward/mean']:.2f}", flush=True)
            if i:
                rows.append(times)
                G = cfg.num_generations * cfg.prompts_per_step
                flops.append(model_flops(args.model, n_prompt, [m["completion/length_mean"]] * G, cfg.beta,
                                         group_size=cfg.num_generations))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                trainer.train_step()
            Path(args.profile).write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    for k, v in matmul_peak(args.threads).items():
        peak[k] = max(peak[k], v)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    step = med["step"]
    achieved = statistics.median(flops) / step
    dtype = "bf16" if bf16 else "fp32"
    print("median: " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()))
    print(f"matmul peak ({args.threads} threads): fp32 {peak['fp32'] / 1e12:.3f}, bf16 {peak['bf16'] / 1e12:.3f} "
          f"TFLOP/s; step achieves {achieved / 1e12:.3f} TFLOP/s = {100 * achieved / peak[dtype]:.1f}% of the "
          f"{dtype} peak (load {os.getloadavg()[0]:.2f})")
    print(f"s_per_step={step:.3f}")


if __name__ == "__main__":
    main()
