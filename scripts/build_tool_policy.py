"""Build the policy of the embedded tool-use task (tasks/products.py) from scratch, and check that GRPO
teaches it to use its calculator.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/build_tool_policy.py            # build + save
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/build_tool_policy.py --skip-build --check-rl

The demo must show GRPO raising tool use within minutes on 2 CPU cores, so the policy starts out
*sometimes* calling the tool: the supervised warm-up teaches a mixture. For each problem the target
is, with probability `--tool-fraction`, the whole tool trajectory (the call with the prompt's
operands, then, after the tool's result, that result as the answer), and otherwise a leading-digit
estimate ("~24000"), which is wrong. The estimate's first token is always "~", so below a tool
fraction of 1/2 greedy decoding estimates (held-out accuracy near 0) while a group of 8 samples
usually holds a tool call that earns reward 1. The loss is on the assistant's tokens only; the
tool's result is context, as in the multi-turn rollouts.

Evaluation goes through the real multi-turn driver (rollout/multiturn.py) over the built-in
engine: greedy accuracy and correct-tool-use rate on the 200 held-out problems, and the sampled
(temperature 1) tool-use rate. `--check-rl` then runs `grouprl`'s Trainer on TOOL_TASK.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from grouprl.rollout import HFEngine, SamplingParams
from grouprl.rollout.multiturn import MultiTurnDriver, TurnLimits
from grouprl.tasks import TOOL_POLICY_DIR, TOOL_TASK
from grouprl.tasks.products import (add_chat_tokens, correct_tool_use, estimate, eval_rows, mul, product_accuracy,
                                    train_rows)
from grouprl.tasks.testing import build_char_tokenizer, build_qwen2
from grouprl.tools import get_tool_parser, resolve_tools


# ---------------------------------------------------------------- data
def segments(tok, a: int, b: int, use_tool: bool) -> list[tuple[str, bool]]:
    """The conversation as (text, is_assistant) pieces, rendered by the task's chat template."""
    user = [{"role": "user", "content": f"{a}*{b}"}]
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False)  # noqa: E731
    if not use_tool:
        return [(render(user), False), (estimate(a, b) + "<|im_end|>", True)]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "mul", "arguments": {"a": a, "b": b}}}]}
    tool = {"role": "tool", "name": "mul", "content": str(a * b)}
    answer = {"role": "assistant", "content": str(a * b)}
    texts = [render(user), render(user + [call]), render(user + [call, tool]), render(user + [call, tool, answer])]
    return [(texts[0], False), (texts[1][len(texts[0]):], True), (texts[2][len(texts[1]):], False),
            (texts[3][len(texts[2]):], True)]


def warmup_batch(tok, pairs, batch_size: int, tool_fraction: float, rng: random.Random):
    ids, labels = [], []
    for _ in range(batch_size):
        a, b = rng.choice(pairs)
        x, y = [], []
        for text, learn in segments(tok, a, b, rng.random() < tool_fraction):
            t = tok(text, add_special_tokens=False)["input_ids"]
            x += t
            y += t if learn else [-100] * len(t)
        ids.append(x)
        labels.append(y)
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])  # [N, L]
    label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])  # [N, L]
    return input_ids, (input_ids != tok.pad_token_id).long(), label_ids


# ---------------------------------------------------------------- evaluation (the real driver)
def evaluate(model, tok, rows, *, samples: int = 4) -> dict[str, float]:
    tools = resolve_tools([mul])
    engine = HFEngine(model, (tok.eos_token_id,), tok.pad_token_id)
    driver = MultiTurnDriver(tok, TurnLimits(TOOL_TASK["max_completion_length"], max_turns=2,
                                                     max_tool_calls=1),
                             tools=tools, parser=get_tool_parser(tok, tools), eos_token_ids=(tok.eos_token_id,))
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False) for r in rows]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    cols = {k: [r[k] for r in rows] for k in ("answer", "a", "b")}
    params = SamplingParams(TOOL_TASK["max_completion_length"], temperature=1.0)
    greedy = driver.generate(engine, ids, 1, replace(params, greedy=True)).messages
    drawn = driver.generate(engine, ids, samples, params, torch.Generator().manual_seed(0)).messages
    rep = {k: [v for v in vals for _ in range(samples)] for k, vals in cols.items()}
    model.train()
    return {
        "greedy_acc": 100 * sum(product_accuracy(None, greedy, **cols)) / len(rows),
        "greedy_tool_use": 100 * sum(correct_tool_use(None, greedy, **cols)) / len(rows),
        "sampled_acc": 100 * sum(product_accuracy(None, drawn, **rep)) / len(drawn),
        "sampled_tool_use": 100 * sum(correct_tool_use(None, drawn, **rep)) / len(drawn),
    }


def fmt(stats: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:5.1f}" for k, v in stats.items())


# ---------------------------------------------------------------- supervised warm-up
def warm_up(args):
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = build_char_tokenizer()
    add_chat_tokens(tok)
    model = build_qwen2(tok, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        intermediate_size=args.mlp, seed=args.seed)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f} M parameters", flush=True)
    pairs = [(r["a"], r["b"]) for r in train_rows()]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / args.steps))
    t0 = time.time()
    for step in range(1, args.steps + 1):
        model.train()
        input_ids, attention_mask, labels = warmup_batch(tok, pairs, args.batch_size, args.tool_fraction, rng)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [N, L, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % args.log_every == 0 or step == args.steps:
            stats = evaluate(model, tok, eval_rows()[:50])
            print(f"step {step:5d}  loss {loss.item():.4f}  {fmt(stats)}  ({time.time() - t0:.0f}s)", flush=True)
    return model, tok


# ---------------------------------------------------------------- GRPO check: the trainer itself
def check_rl(args) -> None:
    """GRPO through grouprl's Trainer on TOOL_TASK; the held-out figures before and after, measured
    with `evaluate` above (greedy and sampled accuracy and correct tool use, 200 problems)."""
    from grouprl.config import TrainConfig
    from grouprl.trainer import Trainer

    cfg = TrainConfig(**{**TOOL_TASK, "model": str(args.out), "output_dir": args.rl_out, "max_steps": args.rl_steps,
                         "learning_rate": args.rl_lr, "report_to": []})
    trainer = Trainer(cfg)
    tok, held_out = trainer.tokenizer, eval_rows()
    print(f"[rl] before  {fmt(evaluate(trainer.model, tok, held_out, samples=8))}", flush=True)
    t0 = time.time()
    summary = trainer.train()
    seconds = time.time() - t0
    print(f"[rl] after   {fmt(evaluate(trainer.model, tok, held_out, samples=8))}", flush=True)
    rows = [r for r in trainer.logger.read_metrics() if "reward/mean" in r]
    print(f"[rl] {len(rows)} steps in {seconds:.0f} s (evals included); train-batch correct tool use "
          f"{rows[0]['rewards/correct_tool_use/mean']:.3f} -> {rows[-1]['rewards/correct_tool_use/mean']:.3f}; "
          f"summary {json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)})}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TOOL_POLICY_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=512)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tool-fraction", type=float, default=0.3)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-build", action="store_true", help="only run --check-rl on the existing --out folder")
    ap.add_argument("--check-rl", action="store_true")
    ap.add_argument("--rl-steps", type=int, default=TOOL_TASK["max_steps"])
    ap.add_argument("--rl-lr", type=float, default=TOOL_TASK["learning_rate"])
    ap.add_argument("--rl-out", default="runs/tool_task_check")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_build:
        model, tok = warm_up(args)
        stats = evaluate(model, tok, eval_rows(), samples=8)
        print(f"final  {fmt(stats)}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
        rounded = {k: round(v, 1) for k, v in stats.items()}
        (args.out / "build_stats.json").write_text(json.dumps(rounded, indent=1) + "\n")
        print(f"saved to {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 2**20:.2f} MiB)")
    if args.check_rl:
        check_rl(args)


if __name__ == "__main__":
    main()
