"""The built-in verifiable task: two-number addition, answered with the bare number.

    prompt     "58+67="     "07+05="
    completion "125" EOS    "12" EOS

Two deliberate departures from the obvious "What is 58+67? Answer: ":
- terse prompts: with a character-level tokenizer every prompt character is a token in
  each rollout and each policy forward pass; on 2 CPU cores the English prompt (23
  tokens) makes every GRPO step about 2.5x slower than "58+67=" (6 tokens).
- operands zero-padded to two digits: each digit sits at a fixed position, which a
  2-layer model learns in a fraction of the steps that variable-width operands need
  (measured: greedy accuracy 21 % vs 2 % after 750 warm-up steps). Answers stay plain.

a and b range over 0..99, so there are 10,000 problems. A fixed, seeded draw of
`EVAL_SIZE` of them is held out for evaluation and never appears in the training rows.
Rows carry `prompt` and `answer` (the correct sum as a string), the columns a
correctness reward such as `math_accuracy` reads.
"""

from __future__ import annotations

import random
import re
from typing import Any

PROMPT_TEMPLATE = "{a:02d}+{b:02d}="
MAX_OPERAND = 99
EVAL_SIZE = 200
_SPLIT_SEED = 1234  # fixes which problems are held out; changing it changes the eval set
_DIGITS = re.compile(r"[0-9]+")


def operands(prompt: str) -> tuple[int, int]:
    """(a, b) from a prompt made by `PROMPT_TEMPLATE`."""
    a, b = prompt.removesuffix("=").split("+")
    return int(a), int(b)


def make_row(a: int, b: int) -> dict[str, str]:
    """The row for the problem a + b: `{"prompt": ..., "answer": str(a + b)}`."""
    return {"prompt": PROMPT_TEMPLATE.format(a=a, b=b), "answer": str(a + b)}


def _split() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All (a, b) pairs, shuffled once with a fixed seed: (train pairs, eval pairs)."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs[EVAL_SIZE:], pairs[:EVAL_SIZE]


def train_rows() -> list[dict[str, str]]:
    """The 9,800 training problems (every pair not held out), in a fixed shuffled order."""
    return [make_row(a, b) for a, b in _split()[0]]


def eval_rows() -> list[dict[str, str]]:
    """The 200 held-out problems, in a fixed order; disjoint from `train_rows()`."""
    return [make_row(a, b) for a, b in _split()[1]]


def make_dataset(n: int, seed: int) -> list[dict[str, str]]:
    """n training problems drawn with replacement from the training pairs; same (n, seed), same rows."""
    if n < 0:
        raise ValueError(f"n={n}: the number of rows must be >= 0")
    train_pairs = _split()[0]
    rng = random.Random(seed)
    return [make_row(*rng.choice(train_pairs)) for _ in range(n)]


def completion_text(completion: Any) -> str:
    """The text of a completion given as a string or as chat messages `[{"role": ..., "content": ...}]`."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(m, dict) and "content" in m for m in completion):
        return "".join(str(m["content"]) for m in completion)
    raise TypeError(
        f"completion of type {type(completion).__name__}: expected a string or a list of "
        '{"role": ..., "content": ...} messages'
    )


def format_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for a completion that is a bare number (digits only, surrounding whitespace ignored), else 0.0.

    TRL's reward signature: one float per completion; `prompts` and extra dataset
    columns in `kwargs` are accepted and unused.
    """
    return [1.0 if _DIGITS.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


format_reward.rowwise = True  # scored row by row: the reward workers may cut a group
