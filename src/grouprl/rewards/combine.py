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

Where the functions run: with a timeout, called from the main thread (the trainer's case, on Unix), in
the main thread itself, stopped at the deadline by a SIGALRM a watchdog thread sends: libraries that
time themselves out with `signal.alarm` (math-verify's `parse` and `verify`, so TRL's and open-r1's
accuracy rewards) raise in any other thread. Elsewhere (another thread, Windows) in a worker thread,
abandoned at the deadline. An `async def` function is run to its end on an event loop of its own. With
reward workers (workers.py, `reward_workers: N`), the functions they take run in worker processes, each
there as here, in slices (whole groups, or rows for a `rowwise` function) and all at once, while the
others run here.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import math
import numbers
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .errors import RewardFunctionError, WorkerDied
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
    fallback: dict[str, Tensor] = field(default_factory=dict)  # name -> [N] bool, rows given `fallback`


class RewardTimeout(Exception):
    """A reward function's call ran past its timeout (`call_reward`)."""


class RewardExited(Exception):
    """A reward function raised SystemExit (or, in its own thread, KeyboardInterrupt) itself: its
    fault, named like any other error, not the end of the run (`sys.exit(3)` would end it with the
    run health's own exit code). In the main thread a KeyboardInterrupt is the user's Ctrl-C: it passes."""

    def __str__(self) -> str:
        return self.args[0]


class _Deadline(BaseException):
    """Raised in the main thread at a reward's deadline; a BaseException, so that a function's own
    `except Exception` (TRL's accuracy_reward has one) does not swallow it."""


_THREADED_HINT = ("; it times itself out with signal.alarm, which works only in the main thread, and it ran in a "
                  "worker thread (the reward timeout, called off the main thread): set reward_timeout_s: null, or "
                  "turn its own timeout off (math_verify: parse(..., parsing_timeout=None), "
                  "verify(..., timeout_seconds=None)) and let reward_timeout_s bound it")


def _invoke(func: Callable, kwargs: dict) -> Any:
    """Call a reward function; what an `async def` one returns is awaited, as TRL does."""
    out = func(**kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def call_reward(func: Callable, kwargs: dict, timeout_s: float | None) -> Any:
    """`func(**kwargs)` under `timeout_s` (RewardTimeout past it), where it is safe to (module docstring),
    each row's value a copy of its own (`_own_copies`)."""
    kwargs = _own_copies(kwargs)
    if inspect.iscoroutinefunction(func) and _loop_running():  # asyncio.run cannot start in a notebook's loop
        return _call_in_thread(func, kwargs, timeout_s)
    if timeout_s is None:
        try:
            return _invoke(func, kwargs)
        except SystemExit as e:
            raise RewardExited(f"SystemExit({e})") from None
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill"):
        return _call_on_main_thread(func, kwargs, timeout_s)
    return _call_in_thread(func, kwargs, timeout_s)


def _own_copies(kwargs: dict) -> dict:
    """The arguments with each row's list or dict value copied: a function that changes its inputs in place
    (a conversation extended with its completion) then changes neither the other rows (a prompt is one
    object for its G completions), nor the functions after it, nor the samples the trainer logs."""
    return {k: [_copy(v) for v in values] if isinstance(values, list) else values for k, values in kwargs.items()}


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, list):  # a conversation (of dicts): deeply; a list of token ids: its items are immutable
        return copy.deepcopy(value) if value and isinstance(value[0], (list, dict)) else list(value)
    return value


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


STUCK_WARNING_S = 10.0  # past the deadline: the function is named in a warning


def _call_on_main_thread(func: Callable, kwargs: dict, timeout_s: float) -> Any:
    """Run the function here, in the main thread, and raise RewardTimeout in it at the deadline. A watchdog
    thread sends the main thread SIGALRM then, and again every 50 ms until the stop is delivered (a
    library may hold SIGALRM with a handler of its own for a while: math-verify does, for its own
    timeouts); once it was, the function has 1 s to unwind (a `finally`, an `__exit__`), and then the
    stop comes every 200 ms: a function that catches it (a bare `except:` around each row) is stopped
    again at each row, not left to run on while other ranks wait. A signal is handled only between
    Python bytecodes: native code that holds the interpreter (a regex that backtracks) runs to its end."""
    live, lock = [True], threading.Lock()
    expired, delivered, finished = threading.Event(), threading.Event(), threading.Event()
    main = threading.get_ident()

    def on_alarm(signum, frame) -> None:
        if not expired.is_set():  # not ours: an alarm the program had set, for its own handler
            if callable(previous):
                previous(signum, frame)
        elif live[0]:
            delivered.set()
            raise _Deadline

    def watchdog() -> None:
        if finished.wait(timeout_s):
            return
        expired.set()
        start, warned, graced = time.monotonic(), False, False
        while True:
            with lock:  # never after `finished`: the handler in place then may be the default, which ends the process
                if finished.is_set():
                    return
                signal.pthread_kill(main, signal.SIGALRM)
            if finished.wait(0.2 if graced else 0.05):  # 50 ms until the first stop is delivered, then 200 ms
                return
            if delivered.is_set() and not graced:  # delivered: 1 s to unwind before the next
                graced = True
                if finished.wait(1.0):
                    return
            waited = time.monotonic() - start
            if waited >= STUCK_WARNING_S and not warned:  # a signal is handled only in Python code
                warned = True
                logger.warning("reward function %s is still running %.0f s past its timeout (reward_timeout_s=%s): "
                               "it catches the stop and goes on (a bare except:), or it is in native code, where "
                               "no signal stops it; the run waits for it", getattr(func, "__name__", func), waited,
                               timeout_s)

    previous = signal.getsignal(signal.SIGALRM)
    signal.signal(signal.SIGALRM, on_alarm)
    thread = threading.Thread(target=watchdog, daemon=True, name=f"reward-deadline-{getattr(func, '__name__', '')}")
    thread.start()
    try:
        try:
            out = _invoke(func, kwargs)
        finally:
            live[0] = False  # one store: from here a late signal does nothing (one that came before it
            # raised _Deadline here, caught below: the function had run past its time)
    except _Deadline:
        if not expired.is_set():  # an enclosing call's deadline (score_completions inside a reward function)
            raise
        out = None
    except SystemExit as e:
        raise RewardExited(f"SystemExit({e})") from None
    finally:
        with lock:
            finished.set()
        thread.join()
        signal.signal(signal.SIGALRM, signal.SIG_IGN)  # drops a signal still pending, then the previous handler
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
    if expired.is_set():
        raise RewardTimeout
    return out


def _call_in_thread(func: Callable, kwargs: dict, timeout_s: float | None) -> Any:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _invoke(func, kwargs)
        except Exception as e:  # handed to the caller's thread
            box["error"] = e
        except BaseException as e:  # noqa: BLE001 -- raised by the function: no signal reaches this thread
            box["error"] = RewardExited(f"{type(e).__name__}({e})")

    # A daemon thread: a function that never returns is abandoned, and cannot block interpreter exit.
    worker = threading.Thread(target=target, daemon=True, name=f"reward-{getattr(func, '__name__', 'func')}")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def _raised(e: BaseException) -> str:
    """What a function raised, for its RewardFunctionError; a signal-based library in a worker thread gets the fix."""
    if isinstance(e, RewardExited):
        return f"raised {e}"
    threaded = "signal only works in main thread" in str(e) or "threaded environment" in str(e)
    return f"raised {type(e).__name__}: {e}" + (_THREADED_HINT if threaded else "")


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


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
        if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # a 0-d tensor or array, a numpy scalar
            v = v.item()
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
        try:
            v = float(v)
        except OverflowError:  # an int past a float's range, e.g. 10**400
            v = math.inf
        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:  # rewards are float32: 1e39 would become inf
            raise RewardFunctionError(name, f"returned {v:g}; rewards must be finite numbers within float32's range "
                                      f"(|r| <= {FLOAT32_MAX:.3g}; return None to skip a row)", row_offset + i)
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


class _Deferred:
    """A call made here when its `result()` is asked for; `cancel()` drops it."""

    def __init__(self, func: Callable, kwargs: dict, timeout_s: float | None):
        self.result = functools.partial(call_reward, func, kwargs, timeout_s)

    def cancel(self) -> None:
        pass


def _start(func: Callable, kwargs: dict, timeout_s: float | None, workers: Any, group_size: int) -> Any:
    """The call of `func` on `kwargs`, started now in the reward workers when they run it (workers.py), else
    deferred: its `result()` is the output (or raises what the call raised)."""
    if workers is not None and workers.runs(func):
        return workers.submit(func, kwargs, len(kwargs["completions"]), group_size, timeout_s)
    return _Deferred(func, kwargs, timeout_s)


def _score_one(call: Any, func: Callable, name: str, prompts: list, completions: list,
               columns: dict, timeout_s: float | None, fallback: float | None, delimiter: str, workers: Any = None
               ) -> tuple[list[float | StepList | None], list[bool]]:
    """One function's validated scores, and which rows got the fallback; `call` is its call on the batch (_start)."""
    n = len(completions)
    try:
        out = call.result()
    except RewardTimeout:
        err = RewardFunctionError(name, f"did not return within timeout_s={timeout_s} s")
        if fallback is None:
            raise err from None
        logger.warning("%s; using fallback %s for all %d rows", err, fallback, n)
        return [fallback] * n, [True] * n
    except (torch.OutOfMemoryError, MemoryError):  # a reward model out of memory: not the rows' fault, and
        raise  # the run's error says what to lower (grouprl.memory), rather than a fallback for every row
    except Exception as batch_error:
        return _score_rows_alone(func, name, prompts, completions, columns, timeout_s, fallback,
                                 delimiter, batch_error, workers)
    try:
        return _validate(name, out, completions, delimiter), [False] * n
    except RewardFunctionError as err:
        if fallback is None:
            raise
        if err.row is None:  # wrong type or length: nothing in the output can be trusted
            logger.warning("%s; using fallback %s for all %d rows", err, fallback, n)
            return [fallback] * n, [True] * n
        values, used = [], []
        for i, v in enumerate(out.tolist() if hasattr(out, "tolist") else out):
            try:
                values.append(_validate(name, [v], completions[i:i + 1], delimiter, i)[0])
                used.append(False)
            except RewardFunctionError as row_err:
                logger.warning("%s; using fallback %s", row_err, fallback)
                values.append(fallback)
                used.append(True)
        return values, used


def _score_rows_alone(func, name, prompts, completions, columns, timeout_s, fallback, delimiter, batch_error,
                      workers=None):
    """The batch call raised: call each row alone to name the failing row(s) (in the workers, all at once)."""
    values: list[float | None] = []
    used: list[bool] = []
    calls = [_start(func, _row_kwargs(prompts, completions, columns, i), timeout_s, workers, 1)
             for i in range(len(completions))]
    for i, call in enumerate(calls):
        try:
            out = call.result()
            values += _validate(name, out, completions[i:i + 1], delimiter, i)
            used.append(False)
        except Exception as e:  # includes RewardTimeout
            if isinstance(e, RewardFunctionError):
                err = e
            elif isinstance(e, RewardTimeout):
                err = RewardFunctionError(name, f"did not return within timeout_s={timeout_s} s", i)
            else:
                err = RewardFunctionError(name, _raised(e), i)
            if fallback is None:
                for later in calls[i + 1:]:
                    later.cancel()
                raise err from e
            logger.warning("%s; using fallback %s", err, fallback)
            values.append(fallback)
            used.append(True)
    if not any(used) and isinstance(batch_error, WorkerDied):  # the process died, not the rows' fault (OOM killer)
        logger.warning("reward function %s: %s; each row alone then succeeded: using those scores", name,
                       batch_error)
        return values, used
    if not any(used):  # every row passed alone: the failure is about the batch as a whole
        err = RewardFunctionError(name, f"{_raised(batch_error)} (each row alone succeeds)")
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
    workers: Any = None,
    group_size: int = 1,
) -> RewardScores:
    """Score N completions with every reward function; weighted nansum, per-function scores, metrics.

    Each function is called as f(prompts=..., completions=..., **columns) — keyword arguments, as TRL
    does. `columns` maps a dataset column to its N values. See the module docstring for faults.
    `step_delimiter` splits a completion into steps for step rewards given by step index. `workers`
    (`RewardWorkers`): the functions they run are called there, all at once, in slices of whole groups of
    `group_size` rows (of rows, for a function marked `rowwise`); the others here, meanwhile, in order.
    """
    n = len(completions)
    columns = dict(columns or {})
    if not funcs:
        raise ValueError("score_completions: no reward functions given; pass at least one")
    weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
    if len(weights) != len(funcs):
        raise ValueError(f"{len(funcs)} reward functions but {len(weights)} weights: give one weight per "
                         "function, or weights=None for all 1.0")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"weights={weights}: every weight must be a finite number (NaN or infinity would make "
                         "every total NaN)")
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} completions: repeat each prompt once per completion")
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"a column is named {key!r}, which would replace the {key} argument: rename it")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    if timeout_s is not None and not (0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s={timeout_s} must be a positive finite number of seconds, or None for no timeout")
    if fallback is not None and not math.isfinite(fallback):
        raise ValueError(f"fallback={fallback} must be a finite number, or None to raise on faults")

    per_func: dict[str, Tensor] = {}
    used: dict[str, Tensor] = {}
    total = torch.zeros(n, dtype=torch.float32)  # [N]
    scored = torch.zeros(n, dtype=torch.bool)  # [N]
    steps: dict[str, list[StepList | None]] = {}
    kwargs = {"prompts": prompts, "completions": completions, **columns}
    names = reward_names(funcs)
    calls = [_start(func, kwargs, timeout_s, workers, group_size) for func in funcs]
    # the trainer's own functions first, while the workers run theirs; summed below in the functions' order
    order = sorted(range(len(funcs)), key=lambda i: not isinstance(calls[i], _Deferred))
    results = {}
    for i in order:
        try:
            results[i] = _score_one(calls[i], funcs[i], names[i], prompts, completions, columns, timeout_s,
                                    fallback, step_delimiter, workers)
        except BaseException:
            for call in calls:  # in the workers: not started yet, and no longer wanted
                call.cancel()
            raise
    for i, (name, w) in enumerate(zip(names, weights)):
        values, fell_back = results[i]
        if any(isinstance(v, list) for v in values):
            steps[name] = [v if isinstance(v, list) else None for v in values]
            values = [_step_mean(v) if isinstance(v, list) else v for v in values]
        r = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)  # [N]
        present = ~torch.isnan(r)  # [N]
        per_func[name], used[name] = r, torch.tensor(fell_back, dtype=torch.bool)
        total += torch.where(present, w * r, torch.zeros_like(r))
        if not bool(total.isfinite().all()):  # each reward finite, their weighted sum past float32's range
            row = int((~total.isfinite()).nonzero()[0])
            raise RewardFunctionError(name, f"weighted by {w:g} and added to the functions before it, gives a total "
                                      f"reward of {float(total[row]):g}: scale the rewards or reward_weights down",
                                      row)
        scored |= present
    all_none = ~scored  # [N]
    if all_none.any():
        rows = all_none.nonzero().flatten().tolist()
        logger.warning("no reward function scored rows %s (every function returned None); their total is 0",
                       rows[:20])
    return RewardScores(total=total, per_func=per_func, metrics=reward_metrics(per_func, used), all_none=all_none,
                        steps=steps, fallback=used)


def _step_mean(steps: StepList) -> float | None:
    return sum(r for _, r in steps) / len(steps) if steps else None


def _mean_std(name: str, scores: Tensor) -> dict[str, float]:
    """`rewards/<name>/mean` and `/std` over the rows the function scored (NaN = abstained)."""
    kept = scores[~torch.isnan(scores)]
    if not kept.numel():
        return {}
    return {f"rewards/{name}/mean": kept.mean().item(),
            f"rewards/{name}/std": kept.std().item() if kept.numel() > 1 else 0.0}


def reward_metrics(per_func: dict[str, Tensor], fallback: dict[str, Tensor] | None = None) -> dict[str, float]:
    """The reward metrics of a set of rows, from the rows themselves: per function the mean and std of its
    scores, how many rows it left None (`num_none`) or gave the fallback (`num_fallback`), and how many rows
    no function scored (`rewards/num_all_none`). `per_func`: name -> [N] (NaN = None); `fallback`: name ->
    [N] bool. So a batch cut (dynamic sampling keeps some groups) or joined (ranks, rounds) describes the
    rows it holds."""
    metrics: dict[str, float] = {}
    scored = None  # [N] bool
    for name, scores in per_func.items():
        present = ~torch.isnan(scores)  # [N]
        metrics.update(_mean_std(name, scores))
        metrics[f"rewards/{name}/num_none"] = float((~present).sum())
        metrics[f"rewards/{name}/num_fallback"] = float(fallback[name].sum()) if fallback and name in fallback else 0.0
        scored = present if scored is None else scored | present
    if scored is not None:
        metrics["rewards/num_all_none"] = float((~scored).sum())
    return metrics
