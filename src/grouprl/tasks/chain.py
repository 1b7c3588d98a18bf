"""A multi-step task for process supervision: running sums of a chain of one-digit additions.

    prompt     "3+4+5+8="
    completion "7\\n12\\n20" EOS        one line per partial sum: 3+4, then +5, then +8

Each line is a step. `chain_steps` gives every line its own reward (1 when it is the right
partial sum, else 0: partial credit for each correct intermediate line), `chain_answer` only
rewards the last line (the outcome). A completion with a wrong intermediate line and the right
answer gets full outcome reward; only the step rewards tell the policy which line was wrong.

Operands are 0..9 and there are `NUM_OPERANDS` of them (10,000 problems); a fixed, seeded draw of
`EVAL_SIZE` is held out. Rows carry `prompt`, `steps` (the partial sums, newline-joined) and
`answer` (the total).
"""

from __future__ import annotations

import random
from typing import Any

from grouprl.rewards.text import completion_text

NUM_OPERANDS = 4
EVAL_SIZE = 200
_SPLIT_SEED = 4321


def partial_sums(operands: list[int]) -> list[int]:
    """[a+b, a+b+c, ...]: the value each line of a right answer holds."""
    sums, total = [], operands[0]
    for x in operands[1:]:
        total += x
        sums.append(total)
    return sums


def make_row(operands: list[int]) -> dict[str, str]:
    sums = partial_sums(operands)
    return {"prompt": "+".join(map(str, operands)) + "=", "steps": "\n".join(map(str, sums)),
            "answer": str(sums[-1])}


def _split() -> tuple[list[list[int]], list[list[int]]]:
    problems = [[int(d) for d in f"{i:0{NUM_OPERANDS}d}"] for i in range(10**NUM_OPERANDS)]
    random.Random(_SPLIT_SEED).shuffle(problems)
    return problems[EVAL_SIZE:], problems[:EVAL_SIZE]


def train_rows() -> list[dict[str, str]]:
    """The 9,800 training problems, in a fixed shuffled order."""
    return [make_row(p) for p in _split()[0]]


def eval_rows() -> list[dict[str, str]]:
    """The 200 held-out problems, disjoint from `train_rows()`."""
    return [make_row(p) for p in _split()[1]]


def _lines(completion: Any) -> list[str]:
    return completion_text(completion).split("\n")


def chain_steps(prompts: list[Any], completions: list[Any], steps: list[str], **kwargs: Any) -> list[list]:
    """Step rewards: (k, 1.0) when line k of the completion is the k-th partial sum, else (k, 0.0);
    lines past the expected number score 0. A completion with no text gets no steps."""
    out = []
    for c, gold in zip(completions, steps):
        want = gold.split("\n")
        lines = _lines(c)
        if lines and lines[-1] == "":  # a trailing newline ends the last step; it is not a step
            lines = lines[:-1]
        out.append([(k, 1.0 if k < len(want) and line.strip() == want[k] else 0.0) for k, line in enumerate(lines)])
    return out


def chain_answer(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """Outcome reward: 1.0 when the last non-empty line is the total, else 0.0."""
    out = []
    for c, gold in zip(completions, answer):
        lines = [line.strip() for line in _lines(c) if line.strip()]
        out.append(1.0 if lines and lines[-1] == gold else 0.0)
    return out


chain_answer.rowwise = True  # scored row by row: the reward workers may cut a group


def chain_exact(prompts: list[Any], completions: list[Any], steps: list[str], **kwargs: Any) -> list[float]:
    """1.0 when every line is right and there are no others (an eval metric)."""
    return [1.0 if completion_text(c).strip() == gold else 0.0 for c, gold in zip(completions, steps)]


chain_exact.rowwise = True  # scored row by row: the reward workers may cut a group
