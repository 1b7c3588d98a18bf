"""Step rewards (process supervision, DeepSeekMath §4.1.3): from reward functions to token indices.

A reward function may return, for a completion, a list of ``(end, reward)`` pairs instead of a float:

    (k, r)              k an ``int``: the k-th step (0-based) of the completion split on the step
                        delimiter (``step_delimiter``, a newline by default); see ``split_steps``
    (CharOffset(e), r)  e a character offset into the completion text: the step is the text up to
                        ``text[:e]`` (exclusive end, 1 <= e <= len(text)), e.g. ``m.end()`` of a regex

A plain int is always a step index and never a character offset: a slip (an offset where an index
was meant) then fails with "out of range" instead of silently crediting the wrong tokens.

The trainer turns these into token steps (`ProcessRewards`):
- a step ending at character e (exclusive) ends at the token holding character e − 1; a step that
  ends at the end of the text ends at the completion's last token (a trailing EOS is credited with
  it). Several steps may end in one token (a BPE token such as "\\n\\n" or "3\\n" can hold the end of
  one step and the start of the next): they stay steps of their own, each normalised apart, as the
  formula has them (summed into one, they changed the group's mean, std and step count, and a group
  whose steps all scored 1 was not flat when a blank line merged into the line before it);
- different functions' steps are one step where they coincide: the weighted rewards of the k-th step
  of each function ending at a token add up (weights are the reward_weights, as for outcome rewards);
- the outcome reward (the weighted sum of the functions that returned a float for the row, plus
  DAPO overlong shaping) counts as one more step at the completion's last token. A batch where no
  function returned steps is thus outcome supervision: every token of completion i gets its
  group-normalised outcome reward, GRPO's advantage. Where no function returned a float, the
  shaping alone is that step, and only where it is non-zero: a step of 0 would still enter the
  group's mean and std, and change every advantage of a run whose completions all fit;
- a function's per-completion score (`RewardScores.per_func`, the reward metrics, the total used by
  eval) is the mean of its step rewards; whether a group is flat (dynamic sampling, the prompt
  filter) is judged on the steps themselves (`StepBatch.flat_groups`).

Character offsets of tokens are read from the tokenizer's own decoding of the completion ids
(`token_char_ends`), not from re-tokenising the text: a sampled completion need not be the
canonical tokenisation of its text.
"""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Sequence

from torch import Tensor

from .errors import RewardFunctionError

StepList = list[tuple[int, float]]  # (exclusive character end, reward), sorted by end


@dataclass(frozen=True)
class CharOffset:
    """A step end given as a character offset into the completion text (exclusive: the step is
    the text up to ``text[:offset]``)."""

    offset: int


def split_steps(text: str, delimiter: str) -> list[int]:
    """Exclusive character ends of the steps of ``text``: each step runs up to and including a
    delimiter; a non-empty rest after the last delimiter is the last step. "a\\nb" -> [2, 3],
    "a\\nb\\n" -> [2, 4], "" -> []."""
    if not delimiter:
        raise ValueError("step_delimiter is empty: steps need a delimiter, e.g. '\\n'")
    ends, start = [], 0
    while (at := text.find(delimiter, start)) >= 0:
        start = at + len(delimiter)
        ends.append(start)
    if start < len(text):
        ends.append(len(text))
    return ends


def is_step_list(value: Any) -> bool:
    """Whether a reward function's value for one completion is a list of steps (not a number/None)."""
    return isinstance(value, (list, tuple))


def parse_steps(value: Sequence, text: str, delimiter: str) -> StepList:
    """Validate one completion's ``(end, reward)`` pairs; return them as (character end, reward)
    sorted by end. Raises ValueError naming the bad pair and the fix."""
    steps: StepList = []
    step_ends: list[int] | None = None
    for j, pair in enumerate(value):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"step {j} is {pair!r}; step rewards are (end, reward) pairs: end an int "
                             "step index or a CharOffset, reward a float")
        end, reward = pair
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise ValueError(f"step {j} has reward {reward!r}; a step reward is a finite float")
        if isinstance(end, CharOffset):
            e = end.offset
            if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= len(text):
                raise ValueError(f"step {j} ends at CharOffset({e!r}), outside the completion's text "
                                 f"(1..{len(text)} characters)")
        elif isinstance(end, int) and not isinstance(end, bool):
            step_ends = split_steps(text, delimiter) if step_ends is None else step_ends
            if not 0 <= end < len(step_ends):
                raise ValueError(f"step index {end} is out of range: the completion has {len(step_ends)} "
                                 f"steps when split on step_delimiter={delimiter!r}; for a character "
                                 "offset, return (CharOffset(offset), reward)")
            e = step_ends[end]
        else:
            raise ValueError(f"step {j} ends at {end!r} ({type(end).__name__}); the end is an int step "
                             "index or a grouprl.rewards.CharOffset")
        steps.append((e, float(reward)))
    return sorted(steps, key=lambda s: s[0])


def token_char_ends(tokenizer, ids: list[int], text: str) -> list[int]:
    """For each token of ``ids``, the character offset in ``text`` where its decoded text ends, with
    ``text == tokenizer.decode(ids, skip_special_tokens=True)`` (tokens that decode to nothing end
    where the previous one did). Each token's piece is its decoding after a few tokens of context
    minus the context's (one batched call); when the pieces do not join into ``text`` (a character
    split over tokens, a decoder that rewrites spaces) every prefix is decoded instead, which is
    exact whatever the decoder does."""
    context = 4
    before = [ids[max(0, k - context):k] for k in range(len(ids))]
    upto = [ids[max(0, k - context):k + 1] for k in range(len(ids))]
    decoded = tokenizer.batch_decode(before + upto, skip_special_tokens=True)
    ends, pos, ok = [], 0, True
    for b, u in zip(decoded[:len(ids)], decoded[len(ids):]):
        if not u.startswith(b) or text[pos:pos + len(u) - len(b)] != u[len(b):]:
            ok = False
            break
        pos += len(u) - len(b)
        ends.append(pos)
    if ok and pos == len(text):
        return ends
    prefixes = tokenizer.batch_decode([ids[:k + 1] for k in range(len(ids))], skip_special_tokens=True)
    ends, reached = [], 0
    for p in prefixes:  # the part of `text` this prefix already spells out (a split character: not yet)
        n = len(p) if text.startswith(p) else _common_prefix(p, text)
        reached = max(reached, n)
        ends.append(reached)
    return ends


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def token_index(char_ends: list[int], end: int, num_tokens: int, text_len: int) -> int:
    """The token holding a step's last character (``end`` exclusive); the last token when the step
    ends the text."""
    if end >= text_len:
        return num_tokens - 1
    return min(bisect.bisect_left(char_ends, end), num_tokens - 1)


@dataclass
class ProcessRewards:
    """Weighted step rewards of N completions at token indices, and their outcome rewards."""

    ends: list[list[int]]       # [N][K_i] token index of each process step's last token, non-decreasing
    rewards: list[list[float]]  # [N][K_i] weighted step reward (functions' coinciding steps summed)
    outcome: list[float | None]  # [N] weighted outcome reward, unshaped; None when no function gave a float
    last: list[int]             # [N] index of the completion's last token
    shaping: list[float]        # [N] DAPO overlong penalty (0.0 when not shaped)

    def select(self, rows: Tensor) -> ProcessRewards:
        r = rows.tolist()
        return ProcessRewards(*([getattr(self, f.name)[i] for i in r] for f in fields(ProcessRewards)))

    @staticmethod
    def cat(parts: list[ProcessRewards]) -> ProcessRewards:
        return ProcessRewards(*([x for p in parts for x in getattr(p, f.name)] for f in fields(ProcessRewards)))

    def with_outcome(self, *, shaped: bool = True) -> tuple[list[list[float]], list[list[int]]]:
        """The steps of each completion, the outcome reward (plus shaping) counting as a final step at its
        last token: (rewards [N][K_i], token ends [N][K_i]), what core's "process" advantage estimator
        reads. Without a float outcome the shaping is a step only where it is non-zero (module docstring).
        ``shaped=False``: the steps before shaping, which decide whether a group is flat."""
        finals = [o if not shaped or s == 0.0 else (o or 0.0) + s for o, s in zip(self.outcome, self.shaping)]
        ends = [e + ([t] if f is not None else []) for e, f, t in zip(self.ends, finals, self.last)]
        rewards = [r + ([f] if f is not None else []) for r, f in zip(self.rewards, finals)]
        return rewards, ends

    def metrics(self) -> dict[str, float]:
        """`process/steps_per_completion` and the mean and min of the (weighted) step rewards."""
        flat = [x for r in self.rewards for x in r]
        out = {"process/steps_per_completion": len(flat) / max(len(self.rewards), 1)}
        if flat:
            out.update({"process/step_reward_mean": sum(flat) / len(flat), "process/step_reward_min": min(flat)})
        return out


def process_rewards(steps: dict[str, list[StepList | None]], per_func: dict[str, Tensor],
                    weights: Sequence[float] | None, token_ids: list[list[int]], texts: list[str],
                    tokenizer, shaping: Tensor | None = None, *, estimator: str = "process"
                    ) -> ProcessRewards | None:
    """Combine the functions' step rewards (``steps``: name -> [N] step lists, None where the function
    gave a float) and outcome rewards (``per_func``: name -> [N], NaN for None) into token steps.
    ``shaping  # [N]`` (DAPO overlong penalty) is kept beside the outcome, which it is added to in
    ``with_outcome``. See the module docstring.
    Under any ``estimator`` but "process": None, and step rewards are an error (they would be lost)."""
    if estimator != "process":
        if steps:
            name = next(iter(steps))
            row = next(i for i, s in enumerate(steps[name]) if s is not None)
            raise RewardFunctionError(name, f"returned step rewards (a list of (end, reward) pairs), but "
                                      f"advantage_estimator={estimator!r} takes one reward per completion: "
                                      "set advantage_estimator: process, or return one float", row)
        return None
    names = list(per_func)
    weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
    out = ProcessRewards([], [], [], [], [])
    for i, (ids, text) in enumerate(zip(token_ids, texts)):
        char_ends = None
        at: dict[tuple[int, int], float] = {}  # (token, k: the k-th step of a function ending there) -> reward
        outcome: float | None = None
        for name, w in zip(names, weights):
            row = steps.get(name, [None] * len(texts))[i]
            if row is None:
                v = float(per_func[name][i])
                if not math.isnan(v):
                    outcome = (outcome or 0.0) + w * v
                continue
            if char_ends is None:
                char_ends = token_char_ends(tokenizer, ids, text)
            seen: dict[int, int] = {}
            for end, r in row:
                t = token_index(char_ends, end, len(ids), len(text))
                k = seen[t] = seen.get(t, -1) + 1
                at[(t, k)] = at.get((t, k), 0.0) + w * r
        out.ends.append([t for t, _ in sorted(at)])
        out.rewards.append([at[key] for key in sorted(at)])
        out.outcome.append(outcome)
        out.last.append(len(ids) - 1)
        out.shaping.append(0.0 if shaping is None else float(shaping[i]))
    return out
