"""Format rewards: R1-style <think>...</think><answer>...</answer> structure, and a regex match.

think_format (strict, DeepSeek-R1 §2.2.2's format reward): 1.0 when the whole completion is exactly one
non-empty think block followed by one non-empty answer block (whitespace around and between them
allowed, nothing else), else 0.0.
think_format_soft: 0.25 for each of the four tags that appears exactly once, so a model that is
learning the format gets a gradient; if all four appear once but out of order the score is 0.75.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from .text import completion_text

_STRICT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _strict_ok(text: str) -> bool:
    m = _STRICT.fullmatch(text)
    if not m or not m.group(1).strip() or not m.group(2).strip():
        return False
    return all(text.count(tag) == 1 for tag in _TAGS)


def think_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 if the completion is exactly <think>…</think><answer>…</answer> (both non-empty), else 0.0."""
    return [1.0 if _strict_ok(completion_text(c)) else 0.0 for c in completions]


think_format.rowwise = True  # scored row by row: the reward workers may cut a group


def think_format_soft(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """0.25 per tag present exactly once; 0.75 at most when all four are present but out of order."""
    scores = []
    for c in completions:
        text = completion_text(c)
        once = [text.count(tag) == 1 for tag in _TAGS]
        score = 0.25 * sum(once)
        if all(once):
            positions = [text.index(tag) for tag in _TAGS]
            if positions != sorted(positions):
                score = 0.75
        scores.append(score)
    return scores


think_format_soft.rowwise = True  # scored row by row: the reward workers may cut a group


def regex_match(pattern: str, *, full: bool = False, ignore_case: bool = False) -> Callable[..., list[float]]:
    """Factory: 1.0 where `pattern` is found in the completion (`full=True`: matches all of it,
    surrounding whitespace stripped), else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL | (re.IGNORECASE if ignore_case else 0))
    except re.error as e:
        raise ValueError(f"regex_match: pattern {pattern!r} is not a valid regular expression: {e}") from e

    def regex_match(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = (completion_text(c) for c in completions)
        if full:
            return [1.0 if compiled.fullmatch(t.strip()) else 0.0 for t in texts]
        return [1.0 if compiled.search(t) else 0.0 for t in texts]

    regex_match.rowwise = True  # scored row by row: the reward workers may cut a group
    return regex_match
