"""Build the policy that `grouprl train` ships with, from scratch, and check that GRPO can improve it.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/build_default_policy.py            # build + save
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/build_default_policy.py --check-rl # + a GRPO check

The default demo must show RL doing something in a few minutes on 2 CPU cores, so the
shipped policy has to start weak on greedy decoding while the right answer is still
reachable by sampling. The supervised warm-up therefore teaches a *mixture*: for each
problem the target is the correct sum with probability `--correct-fraction` and otherwise
the sum with every carry dropped (digit-wise addition mod 10, 58+67 -> "15"). On problems
with a carry the greedy answer follows the bug, while sampling at temperature 1 still
finds the correct sum in roughly a `correct_fraction` share of draws. A group of 8 then
usually holds a correct completion, and group-normalised advantages shift the mode.

Sections: data, model, supervised warm-up, evaluation (greedy and sampled), save, and
an optional throwaway GRPO loop (`--check-rl`) that measures what the demo can expect:
on-policy (one update per rollout, so the clipped ratio is 1 and the loss is REINFORCE
with group-normalised advantages), no KL term, seq-mean-token-mean aggregation.

Measured on a shared 2-core machine (one torch thread, other jobs running, so times are
pessimistic): the build takes ~9 minutes and gives a 0.54 M-parameter policy (2.1 MB)
with held-out greedy accuracy 24.5 %, pass@8 96 % and mean sampled accuracy 51 % at
temperature 1. `--skip-build --check-rl` (16 prompts x 8 completions, lr 1e-4) then
lifts greedy accuracy to 84 % in 20 steps and 98.5 % in 100 steps (85 s, load included).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.tasks import DEFAULT_POLICY_DIR, DEFAULT_TASK
from grouprl.tasks.arithmetic import PROMPT_TEMPLATE, eval_rows, format_reward, operands, train_rows
from grouprl.tasks.testing import build_char_tokenizer, build_qwen2


# ---------------------------------------------------------------- data


def carry_dropped_sum(a: int, b: int) -> str:
    """a + b with every carry dropped: each digit is (digit_a + digit_b) mod 10, e.g. 58+67 -> "15"."""
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return str(digits)


def warmup_batch(tok, pairs, batch_size: int, correct_fraction: float, rng: random.Random):
    """A right-padded batch of prompt + target + EOS with labels only on the target and EOS."""
    ids, labels = [], []
    for _ in range(batch_size):
        a, b = rng.choice(pairs)
        target = str(a + b) if rng.random() < correct_fraction else carry_dropped_sum(a, b)
        p = tok(PROMPT_TEMPLATE.format(a=a, b=b))["input_ids"]
        c = tok(target)["input_ids"] + [tok.eos_token_id]
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])  # [N, L]
    label_ids = torch.tensor([y + [-100] * (width - len(y)) for y in labels])  # [N, L]
    return input_ids, (input_ids != tok.pad_token_id).long(), label_ids


# ---------------------------------------------------------------- sampling (KV-cached)


@torch.no_grad()
def sample(model, tok, prompts: list[str], *, group_size: int = 1, temperature: float = 0.0, max_new_tokens: int = 6):
    """Generate `group_size` completions per prompt (temperature 0 = greedy).

    Returns (prompt_ids [N, P] left-padded, prompt_mask [N, P], completion_ids [N, T],
    completion_mask [N, T] with 1 on tokens up to and including EOS, texts list[str]).
    """
    enc = tok(prompts, padding=True, padding_side="left", return_tensors="pt")
    prompt_ids = enc["input_ids"].repeat_interleave(group_size, 0)  # [N, P]
    prompt_mask = enc["attention_mask"].repeat_interleave(group_size, 0)  # [N, P]
    n = prompt_ids.shape[0]
    mask = prompt_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    done = torch.zeros(n, dtype=torch.bool)
    tokens = []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()  # [N, V]
        if temperature > 0:
            nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1).squeeze(-1)  # [N]
        else:
            nxt = logits.argmax(-1)  # [N]
        nxt = torch.where(done, torch.full_like(nxt, tok.pad_token_id), nxt)
        tokens.append(nxt)
        done |= nxt == tok.eos_token_id
        if done.all():
            break
        mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype)], 1)
        position_ids = position_ids[:, -1:] + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    completion_ids = torch.stack(tokens, 1)  # [N, T]
    is_eos = completion_ids == tok.eos_token_id
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # tokens strictly after the first EOS
    completion_mask = (~after_eos).long()  # [N, T]
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, texts


# ---------------------------------------------------------------- evaluation


def evaluate(model, tok, rows, *, samples: int = 8, temperature: float = 1.0) -> dict[str, float]:
    """Greedy accuracy, and pass@k / mean accuracy / bug rate of `samples` draws at `temperature` (percent)."""
    model.eval()
    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    bugs = [carry_dropped_sum(*operands(p)) for p in prompts]
    *_, greedy = sample(model, tok, prompts)
    *_, drawn = sample(model, tok, prompts, group_size=samples, temperature=temperature)
    hit = torch.tensor([d.strip() == answers[i // samples] for i, d in enumerate(drawn)]).view(-1, samples)
    bug = torch.tensor([d.strip() == bugs[i // samples] != answers[i // samples] for i, d in enumerate(drawn)])
    greedy_hit = torch.tensor([g.strip() == a for g, a in zip(greedy, answers)])
    return {
        "greedy_acc": 100 * greedy_hit.float().mean().item(),
        f"pass@{samples}": 100 * hit.any(1).float().mean().item(),
        "sampled_acc": 100 * hit.float().mean().item(),
        "sampled_bug_rate": 100 * bug.float().mean().item(),
    }


# ---------------------------------------------------------------- supervised warm-up


def warm_up(args) -> tuple[torch.nn.Module, object]:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = build_char_tokenizer()
    model = build_qwen2(
        tok,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.mlp,
        seed=args.seed,
    )
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f} M parameters")
    pairs = [operands(r["prompt"]) for r in train_rows()]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / args.steps)
    )
    t0 = time.time()
    for step in range(1, args.steps + 1):
        model.train()
        input_ids, attention_mask, labels = warmup_batch(tok, pairs, args.batch_size, args.correct_fraction, rng)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [N, L, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        if step % args.log_every == 0 or step == args.steps:
            stats = evaluate(model, tok, eval_rows(), samples=4)
            print(f"step {step:5d}  loss {loss.item():.4f}  {fmt(stats)}  ({time.time() - t0:.0f}s)", flush=True)
    return model, tok


def fmt(stats: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:5.1f}" for k, v in stats.items())


# ---------------------------------------------------------------- GRPO check (throwaway loop)


def check_rl(args) -> None:
    """Load the saved policy fresh and run on-policy GRPO the way the demo would, timing everything."""
    t0 = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    rows, held_out = train_rows(), eval_rows()
    before = evaluate(model, tok, held_out)
    print(f"[rl] before  {fmt(before)}  ({time.time() - t0:.1f}s incl. load)", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0)
    G, B = args.rl_group, args.rl_prompts
    for step in range(1, args.rl_steps + 1):
        batch = rng.sample(rows, B)
        model.eval()
        prompt_ids, prompt_mask, completion_ids, completion_mask, texts = sample(
            model, tok, [r["prompt"] for r in batch], group_size=G, temperature=args.rl_temperature,
            max_new_tokens=args.rl_max_completion_length,
        )
        answers = [batch[i // G]["answer"] for i in range(B * G)]
        correct = torch.tensor([float(t.strip() == a) for t, a in zip(texts, answers)])  # [N]
        rewards = correct + 0.2 * torch.tensor(format_reward(None, texts))  # [N]
        grouped = rewards.view(B, G)
        std = grouped.std(1, keepdim=True)  # sample std, as TRL / verl
        adv = torch.where(std > 0, (grouped - grouped.mean(1, keepdim=True)) / (std + 1e-4), 0.0).view(-1)  # [N]

        model.train()
        input_ids = torch.cat([prompt_ids, completion_ids], 1)  # [N, P+T]
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)  # [N, P+T]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        P = prompt_ids.shape[1]
        logits = logits[:, P - 1 : -1].float()  # [N, T, V] predicts the completion tokens
        logp = torch.gather(F.log_softmax(logits, -1), 2, completion_ids[:, :, None]).squeeze(-1)  # [N, T]
        m = completion_mask.float()  # [N, T]
        loss = -((adv[:, None] * logp * m).sum(1) / m.sum(1).clamp(min=1)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.rl_log_every == 0 or step == args.rl_steps:
            stats = evaluate(model, tok, held_out)
            print(
                f"[rl] step {step:4d}  reward {rewards.mean():.3f}  acc {correct.mean():.3f}  "
                f"zero-std groups {(std == 0).float().mean():.2f}  {fmt(stats)}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
    after = evaluate(model, tok, held_out)
    print(
        f"[rl] after   {fmt(after)}  greedy gain {after['greedy_acc'] - before['greedy_acc']:+.1f} points  "
        f"total wall time {time.time() - t0:.0f}s",
        flush=True,
    )


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_POLICY_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--correct-fraction", type=float, default=0.35)
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument(
        "--threads", type=int, default=1, help="1 keeps the build bit-reproducible, and is faster on a busy machine"
    )
    ap.add_argument("--skip-build", action="store_true", help="only run --check-rl on the existing --out folder")
    ap.add_argument("--check-rl", action="store_true")
    # the check's defaults are the recommended demo settings, so the two cannot drift apart
    ap.add_argument("--rl-steps", type=int, default=DEFAULT_TASK["max_steps"])
    ap.add_argument("--rl-prompts", type=int, default=DEFAULT_TASK["prompts_per_step"])
    ap.add_argument("--rl-group", type=int, default=DEFAULT_TASK["num_generations"])
    ap.add_argument("--rl-lr", type=float, default=DEFAULT_TASK["learning_rate"])
    ap.add_argument("--rl-temperature", type=float, default=DEFAULT_TASK["temperature"])
    ap.add_argument("--rl-max-completion-length", type=int, default=DEFAULT_TASK["max_completion_length"])
    ap.add_argument("--rl-log-every", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if not args.skip_build:
        model, tok = warm_up(args)
        stats = evaluate(model, tok, eval_rows(), samples=8, temperature=1.0)
        print(f"final  {fmt(stats)}")
        args.out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
        (args.out / "build_stats.json").write_text(
            json.dumps({k: round(v, 1) for k, v in stats.items()}, indent=1) + "\n")
        size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
        print(f"saved to {args.out} ({size:.2f} MiB)")
    if args.check_rl:
        check_rl(args)


if __name__ == "__main__":
    main()
