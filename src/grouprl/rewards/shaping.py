"""Length and repetition shaping rewards (factories; each returns a reward function).

Lengths: the trainer passes `completion_lengths` (tokens) to every reward function; without it these
functions fall back to the completion's length in characters, so set the length parameters in
characters then.

length_target:   r = max(0, 1 − |L − target| / scale), scale defaults to target.
cosine_length:   Yeo et al. 2025 ("Demystifying Long Chain-of-Thought Reasoning in LLMs") cosine
                 reward, r = r_L + ½(r_0 − r_L)(1 + cos(π·min(L, L_max)/L_max)) where (r_0, r_L) =
                 (max_value_correct, min_value_correct) for a correct answer (short and right is best)
                 and (min_value_wrong, max_value_wrong) for a wrong one (short and wrong is worst).
                 Correctness is `verify_math` against the `answer`/`solution` column; a row whose gold
                 cannot be parsed gets None. Departure: no separate exceed penalty, L is clamped at L_max.
repetition_penalty: r = max_penalty · (1 − distinct n-grams / n-grams) over whitespace words
                 (0 for texts shorter than n words), as in open-r1.
overlong_penalty: DAPO soft overlong punishment, `grouprl.core.overlong_penalty`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .text import column, completion_text
from .math import verify_math

RewardFunc = Callable[..., list]


def completion_lengths(completions: list[Any], kwargs: dict) -> list[int]:
    """Token lengths from the `completion_lengths` column when the trainer passes it, else characters."""
    lengths = kwargs.get("completion_lengths")
    if lengths is not None:
        lengths = [int(x) for x in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
        if len(lengths) != len(completions):
            raise ValueError(f"completion_lengths has {len(lengths)} values for {len(completions)} completions")
        return lengths
    return [len(completion_text(c)) for c in completions]


def length_target(target: int, scale: float | None = None) -> RewardFunc:
    """Factory: 1 at exactly `target` length, falling linearly to 0 at `scale` away (default target)."""
    if target <= 0:
        raise ValueError(f"length_target: target={target} must be a positive length")
    scale = float(scale if scale is not None else target)
    if scale <= 0:
        raise ValueError(f"length_target: scale={scale} must be positive")

    def length_target(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        return [max(0.0, 1.0 - abs(L - target) / scale) for L in completion_lengths(completions, kwargs)]

    length_target.rowwise = True  # scored row by row: the reward workers may cut a group
    return length_target


def cosine_length(
    max_len: int = 1000,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> RewardFunc:
    """Factory: correctness-aware cosine length reward (module docstring)."""
    if max_len <= 0:
        raise ValueError(f"cosine_length: max_len={max_len} must be positive")

    def cosine(L: int, r0: float, rL: float) -> float:
        t = min(L, max_len)
        return rL + 0.5 * (r0 - rL) * (1.0 + math.cos(math.pi * t / max_len))

    def cosine_length(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        golds = column(kwargs, ("answer", "solution"), len(completions), "cosine_length")
        out: list[float | None] = []
        for c, g, L in zip(completions, golds, completion_lengths(completions, kwargs)):
            ok = None if g is None else verify_math(completion_text(c), str(g))
            if ok is None:
                out.append(None)
            elif ok:
                out.append(cosine(L, max_value_correct, min_value_correct))
            else:
                out.append(cosine(L, min_value_wrong, max_value_wrong))
        return out

    cosine_length.rowwise = True  # scored row by row: the reward workers may cut a group
    cosine_length.needs_column = ("answer", "solution")  # one of them: checked when the data loads
    return cosine_length


def repetition_penalty(ngram_size: int = 3, max_penalty: float = -1.0) -> RewardFunc:
    """Factory: max_penalty × fraction of repeated word n-grams (0 for no repetition)."""
    if ngram_size < 1:
        raise ValueError(f"repetition_penalty: ngram_size={ngram_size} must be at least 1")
    if max_penalty > 0:
        raise ValueError(f"repetition_penalty: max_penalty={max_penalty} must be <= 0 (it is a penalty)")

    def repetition_penalty(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        out = []
        for c in completions:
            words = completion_text(c).lower().split()
            if len(words) < ngram_size:
                out.append(0.0)
                continue
            ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
            out.append(max_penalty * (1.0 - len(set(ngrams)) / len(ngrams)))
        return out

    repetition_penalty.rowwise = True  # scored row by row: the reward workers may cut a group
    return repetition_penalty


def overlong_penalty(max_len: int, cache_len: int) -> RewardFunc:
    """Factory: DAPO soft overlong punishment from `grouprl.core` on `completion_lengths` (tokens;
    characters when the column is absent)."""
    if max_len <= 0 or not 0 <= cache_len <= max_len:
        raise ValueError(f"overlong_penalty: max_len={max_len}, cache_len={cache_len}: need max_len > 0 "
                         "and 0 <= cache_len <= max_len")

    def overlong_penalty(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        import torch

        from grouprl.core import overlong_penalty as dapo_overlong

        lengths = torch.tensor(completion_lengths(completions, kwargs), dtype=torch.long)  # [N]
        return dapo_overlong(lengths, max_len, cache_len).tolist()

    overlong_penalty.rowwise = True  # scored row by row: the reward workers may cut a group
    return overlong_penalty
