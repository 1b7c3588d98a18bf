"""Combining reward functions: `score_completions` -> `RewardScores`.

total_i = Σ_f w_f · r_{f,i}, summing only the functions that scored row i (None = missing, i.e. a
nansum). A function may also return, for a row, a list of (end, reward) step pairs (process
supervision, see process.py): they are checked here, kept in `RewardScores.steps`, and the row's
score is the mean of its step rewards. A row that every function left None gets total 0 and is
flagged in `all_none` and counted in the metrics: the trainer decides what to do with it.

Faults never become silent zeros. A function that raises, runs past `timeout_s`, returns the wrong
number of values, a non-number, NaN or ±inf raises `RewardFunctionError` naming the function (and the
row when known) — unless `fallback` is set, in which case the affected rows get `fallback`, a warning
is logged and `rewards/<name>/num_fallback` counts them. When a batch call raises, each row is retried
alone to find the failing rows (only rows that fail alone get the fallback).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .errors import RewardFunctionError
from .text import completion_text
from .process import StepList, is_step_list, parse_steps

logger = logging.getLogger(__name__)


@dataclass
class RewardScores:
    total: Tensor  # [N] float32, weighted nansum over functions
    per_func: dict[str, Tensor]  # name -> [N] float32, NaN where the function returned None
    metrics: dict[str, float] = field(default_factory=dict)
    all_none: Tensor | None = None  # [N] bool, rows no function scored
    steps: dict[str, list[StepList | None]] = field(default_factory=dict)  # name -> [N] step rewards
    # (character end, reward), None where the function gave a float or None; functions with steps only


class _Timeout(Exception):
    pass


class _Exited(Exception):
    """A reward function raised SystemExit (or, in its own thread, KeyboardInterrupt) itself: its
    fault, named like any other error, not the end of the run (`sys.exit(3)` would end it with the
    run health's own exit code). In the main thread a KeyboardInterrupt is the user's Ctrl-C: it passes."""

    def __str__(self) -> str:
        return self.args[0]


def _call(func: Callable, kwargs: dict, timeout_s: float | None) -> Any:
    if timeout_s is None:
        try:
            return func(**kwargs)
        except SystemExit as e:
            raise _Exited(f"SystemExit({e})") from None
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = func(**kwargs)
        except Exception as e:  # handed to the caller's thread
            box["error"] = e
        except BaseException as e:  # noqa: BLE001 -- raised by the function: no signal reaches this thread
            box["error"] = _Exited(f"{type(e).__name__}({e})")

    # A daemon thread: a function that never returns is abandoned, and cannot block interpreter exit.
    worker = threading.Thread(target=target, daemon=True, name=f"reward-{getattr(func, '__name__', 'func')}")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _Timeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def _validate(name: str, out: Any, completions: list, delimiter: str, row_offset: int = 0
              ) -> list[float | StepList | None]:
    """Check one function's output; return floats / step lists / None. Raises RewardFunctionError."""
    n = len(completions)
    shape = getattr(out, "shape", None)
    if shape is not None and len(shape) > 1:  # e.g. [N, 1]: its rows would read as step lists
        raise RewardFunctionError(name, f"returned an array of shape {tuple(shape)}; a reward function returns "
                                  "one float (or None) per completion: flatten it (e.g. `.reshape(-1)`)")
    if isinstance(out, Tensor) or hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, Sequence) or isinstance(out, (str, bytes)):
        raise RewardFunctionError(name, f"returned {type(out).__name__}; a reward function returns a list "
                                  "with one float (or None) per completion")
    if len(out) != n:
        raise RewardFunctionError(name, f"returned {len(out)} values for {n} completions")
    values: list[float | StepList | None] = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if is_step_list(v):
            try:
                values.append(parse_steps(v, completion_text(completions[i]), delimiter))
            except ValueError as e:
                raise RewardFunctionError(name, str(e), row_offset + i) from None
            continue
        if not isinstance(v, numbers.Real):
            raise RewardFunctionError(name, f"returned {v!r} ({type(v).__name__}), not a number or None",
                                      row_offset + i)
        v = float(v)
        if not math.isfinite(v):
            raise RewardFunctionError(name, f"returned {v}; rewards must be finite (return None to skip a row)",
                                      row_offset + i)
        values.append(v)
    return values


def reward_names(funcs: Sequence[Callable]) -> list[str]:
    """The names reward (or audit) functions are scored, logged and watched under: each function's
    `__name__`, else its type's (a functools.partial), with `_2`, `_3`, ... on a name's repeats."""
    names, seen = [], {}
    for f in funcs:
        base = getattr(f, "__name__", None) or type(f).__name__
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return names


def _row_kwargs(prompts: list, completions: list, columns: dict, i: int) -> dict:
    return {"prompts": prompts[i : i + 1], "completions": completions[i : i + 1],
            **{k: v[i : i + 1] for k, v in columns.items()}}


def _score_one(func: Callable, name: str, prompts: list, completions: list, columns: dict,
               timeout_s: float | None, fallback: float | None, delimiter: str
               ) -> tuple[list[float | StepList | None], int]:
    """One function's validated scores and how many rows got the fallback."""
    n = len(completions)
    try:
        out = _call(func, {"prompts": prompts, "completions": completions, **columns}, timeout_s)
    except _Timeout:
        err = RewardFunctionError(name, f"did not return within timeout_s={timeout_s} s")
        if fallback is None:
            raise err from None
        logger.warning("%s; using fallback %s for all %d rows", err, fallback, n)
        return [fallback] * n, n
    except Exception as batch_error:
        return _score_rows_alone(func, name, prompts, completions, columns, timeout_s, fallback,
                                 delimiter, batch_error)
    try:
        return _validate(name, out, completions, delimiter), 0
    except RewardFunctionError as err:
        if fallback is None:
            raise
        if err.row is None:  # wrong type or length: nothing in the output can be trusted
            logger.warning("%s; using fallback %s for all %d rows", err, fallback, n)
            return [fallback] * n, n
        values, used = [], 0
        for i, v in enumerate(out.tolist() if hasattr(out, "tolist") else out):
            try:
                values.append(_validate(name, [v], completions[i:i + 1], delimiter, i)[0])
            except RewardFunctionError as row_err:
                logger.warning("%s; using fallback %s", row_err, fallback)
                values.append(fallback)
                used += 1
        return values, used


def _score_rows_alone(func, name, prompts, completions, columns, timeout_s, fallback, delimiter, batch_error):
    """The batch call raised: call each row alone to name the failing row(s)."""
    values: list[float | None] = []
    used = 0
    for i in range(len(completions)):
        try:
            out = _call(func, _row_kwargs(prompts, completions, columns, i), timeout_s)
            values += _validate(name, out, completions[i:i + 1], delimiter, i)
        except Exception as e:  # includes _Timeout
            if isinstance(e, RewardFunctionError):
                err = e
            elif isinstance(e, _Timeout):
                err = RewardFunctionError(name, f"did not return within timeout_s={timeout_s} s", i)
            elif isinstance(e, _Exited):
                err = RewardFunctionError(name, f"raised {e}", i)
            else:
                err = RewardFunctionError(name, f"raised {type(e).__name__}: {e}", i)
            if fallback is None:
                raise err from e
            logger.warning("%s; using fallback %s", err, fallback)
            values.append(fallback)
            used += 1
    if used == 0:  # every row passed alone: the failure is about the batch as a whole
        err = RewardFunctionError(name, f"raised {type(batch_error).__name__}: {batch_error} "
                                  "(each row alone succeeds)")
        if fallback is None:
            raise err from batch_error
        logger.warning("%s; using the per-row scores", err)
    return values, used


def score_completions(
    funcs: Sequence[Callable],
    weights: Sequence[float] | None,
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list] | None = None,
    *,
    timeout_s: float | None = None,
    fallback: float | None = None,
    step_delimiter: str = "\n",
) -> RewardScores:
    """Score N completions with every reward function; weighted nansum, per-function scores, metrics.

    Each function is called as f(prompts=..., completions=..., **columns) — keyword arguments, as TRL
    does. `columns` maps a dataset column to its N values. See the module docstring for faults.
    `step_delimiter` splits a completion into steps for step rewards given by step index.
    """
    n = len(completions)
    columns = dict(columns or {})
    if not funcs:
        raise ValueError("score_completions: no reward functions given; pass at least one")
    weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(funcs):
        raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights: give one weight per "
                         "function, or weights=None for all 1.0")
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions: repeat each prompt once per completion")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive, or None for no timeout")
    if fallback is not None and not math.isfinite(fallback):
        raise ValueError(f"fallback={fallback} must be a finite number, or None to raise on faults")

    per_func: dict[str, Tensor] = {}
    metrics: dict[str, float] = {}
    total = torch.zeros(n, dtype=torch.float32)  # [N]
    scored = torch.zeros(n, dtype=torch.bool)  # [N]
    steps: dict[str, list[StepList | None]] = {}
    for func, name, w in zip(funcs, reward_names(funcs), weights):
        values, used = _score_one(func, name, prompts, completions, columns, timeout_s, fallback, step_delimiter)
        if any(isinstance(v, list) for v in values):
            steps[name] = [v if isinstance(v, list) else None for v in values]
            values = [_step_mean(v) if isinstance(v, list) else v for v in values]
        r = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)  # [N]
        present = ~torch.isnan(r)  # [N]
        per_func[name] = r
        total += torch.where(present, w * r, torch.zeros_like(r))
        scored |= present
        metrics.update(_mean_std(name, r))
        metrics[f"rewards/{name}/num_none"] = float(n - int(present.sum()))
        metrics[f"rewards/{name}/num_fallback"] = float(used)
    all_none = ~scored  # [N]
    metrics["rewards/num_all_none"] = float(all_none.sum())
    if all_none.any():
        rows = all_none.nonzero().flatten().tolist()
        logger.warning("no reward function scored rows %s (every function returned None); their total is 0",
                       rows[:20])
    return RewardScores(total=total, per_func=per_func, metrics=metrics, all_none=all_none, steps=steps)


def _step_mean(steps: StepList) -> float | None:
    return sum(r for _, r in steps) / len(steps) if steps else None


def _mean_std(name: str, scores: Tensor) -> dict[str, float]:
    """`rewards/<name>/mean` and `/std` over the rows the function scored (NaN = abstained)."""
    kept = scores[~torch.isnan(scores)]
    if not kept.numel():
        return {}
    return {f"rewards/{name}/mean": kept.mean().item(),
            f"rewards/{name}/std": kept.std().item() if kept.numel() > 1 else 0.0}


def merge_reward_metrics(parts: list[dict[str, float]], per_func: dict[str, Tensor]) -> dict[str, float]:
    """Metrics of several scored batches joined into one: the counts (`.../num_...`) are summed, the
    means and stds recomputed on `per_func` (name -> [N]), the joined scores."""
    out = {k: sum(p.get(k, 0.0) for p in parts) for k in parts[0] if "/num_" in k}
    for name, scores in per_func.items():
        out.update(_mean_std(name, scores))
    return out
