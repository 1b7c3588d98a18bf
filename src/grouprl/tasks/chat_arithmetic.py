"""Chat arithmetic for a pretrained instruct model: "What is 37+48? ..." as a user turn.

    prompt      [{"role": "user", "content": "What is 37+48? Put the final answer in \\boxed{}."}]
    answer      "85"
    completion  "37 + 48 = 85"            lenient: correct     strict: wrong (no \\boxed{})
                "37 + 48 = \\boxed{85}"   lenient: correct     strict: correct

Two scorings of the same completion:
- lenient, `math_accuracy`: the last number of the reply (or the boxed one) equals the sum;
- strict, `boxed_accuracy` here: the answer must sit in \\boxed{} and be right.

The training reward in examples/smollm2_chat_arithmetic.yaml is lenient correctness plus half a
point for a right answer inside \\boxed{} (`boxed_accuracy`, weight 0.5). SmolLM2-135M-Instruct
almost never boxes its answer at first, so a strict-only reward is 0 for nearly every sample:
every group has zero spread, zero advantage, and GRPO learns nothing. A bonus for boxing anything
(`boxed_format`) is hacked: the policy boxes random numbers. The lenient term gives a gradient
from the first step; the strict bonus pays for the format only together with the right answer.

Operands are two-digit (10..99): the untrained model gets a few of these right greedily and
more by sampling, which is what GRPO needs. A seeded draw of `EVAL_SIZE` problems is held out.
"""

from __future__ import annotations

import random
import re
from typing import Any

from grouprl.tasks.arithmetic import completion_text

INSTRUCTION = "What is {a}+{b}? Put the final answer in \\boxed{{}}."
LOW, HIGH = 10, 99
EVAL_SIZE = 64
_SPLIT_SEED = 4321
_BOXED = re.compile(r"\\boxed\{\s*([-+]?\d+)\s*\}")


def _row(a: int, b: int) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": INSTRUCTION.format(a=a, b=b)}], "answer": str(a + b)}


def _split() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs[EVAL_SIZE:], pairs[:EVAL_SIZE]


def train_rows() -> list[dict[str, Any]]:
    """Every two-digit pair not held out (8,036 rows), in a fixed shuffled order."""
    return [_row(a, b) for a, b in _split()[0]]


def eval_rows() -> list[dict[str, Any]]:
    """The `EVAL_SIZE` held-out problems, disjoint from `train_rows()`."""
    return [_row(a, b) for a, b in _split()[1]]


def boxed_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the reply puts an integer in \\boxed{}, right or wrong; else 0.0."""
    return [1.0 if _BOXED.search(completion_text(c)) else 0.0 for c in completions]


boxed_format.rowwise = True  # scored row by row: the reward workers may cut a group


def boxed_accuracy(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Strict correctness: 1.0 when the last \\boxed{} integer equals `answer`, else 0.0."""
    out = []
    for c, gold in zip(completions, kwargs["answer"]):
        boxed = _BOXED.findall(completion_text(c))
        out.append(1.0 if boxed and int(boxed[-1]) == int(gold) else 0.0)
    return out


boxed_accuracy.rowwise = True  # scored row by row: the reward workers may cut a group
