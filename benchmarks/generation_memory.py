"""Peak memory of one generation call of the built-in engine (HFEngine; its FastDecoder for Llama and
Qwen2 models): --rows completions of up to --max-new-tokens new tokens of the model in --model.

    HF_HUB_OFFLINE=1 python benchmarks/generation_memory.py --model models/smollm2 --rows 4 --ignore-eos
    HF_HUB_OFFLINE=1 python benchmarks/generation_memory.py --model models/smollm2 --stop-early
    HF_HUB_OFFLINE=1 python benchmarks/generation_memory.py --model models/smollm2    # rows stop at EOS
    HF_HUB_OFFLINE=1 python benchmarks/generation_memory.py --model models/smollm2 --stop-early --second-turn

Rows stop at EOS (an instruct model ends most answers within a few hundred tokens), at every step's
end with --ignore-eos (every row decodes --max-new-tokens), or with --stop-early also at the first
token that ends a sentence or a line (all rows stop within tens of tokens, at different steps).
The prompts are short questions, in the model's chat template where it has one, --group rows each.
With --second-turn the call measured is a conversation's second one (inside `keep_conversations`,
after a first call with the same settings): each row's prompt is its first prompt, its completion
and a follow-up question, and the engine continues the rows that stopped from their kept caches.

Peak RSS is the kernel's high-water mark of resident memory (VmHWM, what `ru_maxrss` reports): it is
reset after the model is loaded (/proc/self/clear_refs), so the peak is that of generating, not of
loading; where the reset is not possible the script says so and reports ru_maxrss. The weights are
read once before the measured call (a safetensors file is mapped lazily: their first read would
count as generating). Pages allocated but never written do not count. One measurement per process.

Measured on a shared 2-core CPU, SmolLM2-135M fp32, 1 thread, 16 rows x up to 4,096 tokens (peak RSS
while generating, above the loaded model): rows stopping at EOS (mean 57, max 158 tokens) +642 MiB
before the cache grew in blocks, +609 MiB after; --stop-early +594 / +609 MiB; --stop-early
--second-turn +3,127 / +254 MiB. Of a first call's ~600 MiB, ~545 MiB are the decoder's oneDNN-packed
copy of the weights (llama_decoder.py), not the cache: a first call's unwritten cache pages were
never resident on CPU, while a continuation zeroed its whole rows x (prompt + 4,096) cache.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.rollout import HFEngine, SamplingParams

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 12 times 7?",
             "Write a haiku about rain.", "Why is the sky blue?", "Give me a word that rhymes with cat.",
             "How many legs does a spider have?", "What is the boiling point of water?"]


def rss_mib(field: str) -> float:
    """VmRSS / VmHWM of this process from /proc/self/status, in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def sentence_end_ids(tok) -> list[int]:
    """Every token whose text ends a sentence or a line."""
    return [i for i in range(len(tok)) if tok.decode([i]).rstrip(" ").endswith((".", "!", "?", "\n"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model folder (e.g. from scripts/fetch_smollm2.py)")
    ap.add_argument("--rows", type=int, default=16, help="completions decoded together")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (rows / group prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    stop = ap.add_mutually_exclusive_group()
    stop.add_argument("--ignore-eos", action="store_true", help="every row decodes --max-new-tokens")
    stop.add_argument("--stop-early", action="store_true", help="also stop at a sentence or line end")
    ap.add_argument("--second-turn", action="store_true", help="measure a conversation's second call")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.rows % args.group:
        ap.error(f"--rows {args.rows} is not a multiple of --group {args.group}: pick rows = prompts x group")

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.rows // args.group)]
    if tok.chat_template:
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for q in questions]
    else:
        prompts = [tok(q)["input_ids"] for q in questions]
    stops = (tok.eos_token_id, *(sentence_end_ids(tok) if args.stop_early else ()))
    engine = HFEngine(model, stops, tok.pad_token_id)
    params = SamplingParams(args.max_new_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)

    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())  # page the mapped weights in

    def measured(prompts: list[list[int]], group: int):
        before, reset = rss_mib("VmRSS"), reset_peak()
        t0 = time.perf_counter()
        rollout = engine.generate(prompts, group, params, generator)
        seconds = time.perf_counter() - t0
        peak = rss_mib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return rollout, seconds, before, peak, reset

    if args.second_turn:
        with engine.keep_conversations():
            first = engine.generate(prompts, args.group, params, generator)
            follow_up = tok("\nAnd why is that?")["input_ids"]
            prompts = [p[m.bool()].tolist() + c[cm].tolist() + follow_up for p, m, c, cm in
                       zip(first.prompt_ids, first.prompt_mask, first.completion_ids, first.completion_mask)]
            rollout, seconds, before, peak, reset = measured(prompts, 1)  # each row its own conversation
    else:
        rollout, seconds, before, peak, reset = measured(prompts, args.group)
    lengths = rollout.completion_mask.sum(-1)  # [rows]
    mode = "ignore_eos" if args.ignore_eos else "stop_early" if args.stop_early else "eos"
    mode += ", second turn" if args.second_turn else ""
    print(f"{args.rows} rows x up to {args.max_new_tokens} new tokens ({mode}), {args.threads} thread(s): "
          f"completion lengths mean {lengths.float().mean():.0f}, max {int(lengths.max())}; {seconds:.1f} s")
    print(f"RSS before generate {before:.0f} MiB, peak while generating {peak:.0f} MiB "
          f"(+{peak - before:.0f} MiB){'' if reset else ' (ru_maxrss: peak of the whole process, loading included)'}")
    print(json.dumps({"rows": len(lengths), "max_new_tokens": args.max_new_tokens, "mode": mode,
                      "mean_length": float(lengths.float().mean()), "max_length": int(lengths.max()),
                      "tokens": int(lengths.sum()), "seconds": seconds, "rss_before_mib": before,
                      "peak_rss_mib": peak, "peak_is_generation_only": reset}))


if __name__ == "__main__":
    main()
