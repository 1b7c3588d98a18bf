"""Reward functions in worker processes: `RewardWorkers` (config `reward_workers: N`).

A reward written in Python runs in the trainer's process, one row after another: math-verify reads a
LaTeX answer with an antlr grammar and compares it with sympy, ~5 ms a row on a CPU, so 512 completions
take seconds of one core while the others, and on a GPU machine the GPU, wait. With N workers each
function's call on a batch is cut into N slices of whole groups (the G completions of a prompt stay
together: a function may compare a completion with its group), the slices run in N processes at once,
and their outputs are joined in row order. Functions run at the same time as each other, too, and
those kept in the trainer's process (below) run while the workers do.

What stays in the trainer's process: functions marked `in_process = True` (the reward and process
reward models: they hold a model, perhaps on the GPU), and functions that cannot be sent to another
process (a lambda, a closure), named once in a warning. A function configured by name or import path
goes as its config entry and is built again in the worker (a factory's closure does not pickle); a
function passed as a Python object goes by pickle (a module-level function by its import path). Every
function is loaded in a worker when the workers start, so one a worker cannot import fails the run
before its first step, not in it.

A worker runs a function as the trainer would (`combine.call_reward`: its own timeout in its own main
thread, where math-verify's `signal.alarm` works), and sends back the output or what was raised,
validated in the trainer as any output. A worker that does not answer by the timeout plus
`KILL_GRACE_S` (native code that no signal stops) is killed and replaced: that call is a timeout. A
worker that dies (a segfault, `os._exit`) is replaced and the call raises `WorkerDied`, so the rows are
retried one by one to name the row that kills it, like any error.

The workers are forked from a fork server (spawned where there is none) that imported `grouprl.rewards`
and the caller's modules once (the trainer's: Python's multiprocessing runs a script's top level again
in each worker, and its imports are then already there) and froze them out of the garbage collector: a
worker costs a fork, not a Python start, and ~5 MiB of its own until it parses. The workers read
nothing of the trainer's memory.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

from .combine import call_reward, RewardExited, RewardTimeout

logger = logging.getLogger(__name__)

KILL_GRACE_S = 3.0  # past a call's timeout: its worker is killed (its own stop had 1 s to unwind)
SLICES_PER_WORKER = 4  # a batch's slices per worker at most, taken in turn as workers come free


class WorkerDied(RuntimeError):
    """The worker process running a reward function ended during the call (a crash, os._exit)."""


@dataclass
class _Task:
    key: int
    kwargs: dict
    timeout_s: float | None
    done: bool = False
    reply: tuple | None = None
    deadline: float | None = None


@dataclass
class _Worker:
    process: Any
    conn: Connection
    loaded: set[int] = field(default_factory=set)
    task: _Task | None = None


class Pending:
    """One function's call on a batch, in flight: `result()` waits for its slices and joins them."""

    def __init__(self, pool: RewardWorkers, tasks: list[_Task]):
        self._pool, self._tasks = pool, tasks

    def cancel(self) -> None:
        """Drop the slices no worker has started (the batch failed on another function)."""
        self._pool._cancel(self._tasks)

    def result(self) -> Any:
        self._pool._run_until(lambda: all(t.done for t in self._tasks))
        outs = []
        for t in self._tasks:  # the first slice's fault is the call's, as in-process the first bad row would be
            kind, *rest = t.reply
            if kind == "timeout":  # as combine's in-process call raises them
                raise RewardTimeout
            if kind == "exited":
                raise RewardExited(rest[0])
            if kind == "died":
                raise WorkerDied(rest[0])
            if kind == "error":
                raise _rebuilt(*rest)
            outs.append(rest[0])
        return outs[0] if len(outs) == 1 else _joined(outs)


class RewardWorkers:
    """`n` worker processes that run reward functions on slices of a batch (module docstring)."""

    def __init__(self, n: int, funcs: Sequence[Callable], specs: Sequence[Any] | None = None,
                 preload: Sequence[str] = ()):
        """`funcs`: the reward and audit functions the workers may run; `specs[i]`, when given, is the
        config entry `funcs[i]` was built from, and the worker builds it from that. `preload`: modules the
        fork server imports once for every worker (the caller's: a script's top level runs again in each
        worker, and what it imports is then already there)."""
        if n < 1:
            raise ValueError(f"reward_workers={n}: give at least 1 worker process, or 0 to score in the trainer")
        self.n = n
        self._payloads: dict[int, bytes] = {}  # key -> what a worker builds the function from
        self._keys: dict[int, int] = {}  # id(func) -> key
        specs = list(specs) if specs is not None else [None] * len(funcs)
        for func, spec in zip(funcs, specs):
            if getattr(func, "in_process", False) or id(func) in self._keys:
                continue
            payload, why = _payload(func, spec)
            if payload is None:
                logger.warning("reward function %s runs in the trainer's process, not in the reward workers: %s",
                               _name(func), why)
                continue
            self._keys[id(func)] = len(self._payloads)
            self._payloads[len(self._payloads)] = payload
        self._names = {self._keys[id(f)]: _name(f) for f in funcs if id(f) in self._keys}
        self._queue: deque[_Task] = deque()
        self._lock = threading.RLock()
        self._workers: list[_Worker] = []
        self._context = _context(preload)
        if not self._payloads:
            logger.warning("reward_workers=%d, but every reward function runs in the trainer's process (marked "
                           "in_process, or it cannot be pickled): no worker was started", n)
            return
        start = time.perf_counter()
        self._workers = [self._start() for _ in range(n)]
        self._check_loads()
        logger.info("reward workers: %d processes started in %.1f s; in them: %s", n, time.perf_counter() - start,
                    ", ".join(self._names.values()) or "no function")

    def runs(self, func: Callable) -> bool:
        """Whether `func` runs in the workers (else in the trainer's process)."""
        return id(func) in self._keys and bool(self._workers)

    def submit(self, func: Callable, kwargs: dict, rows: int, group_size: int, timeout_s: float | None) -> Pending:
        """Start `func(**kwargs)` on `rows` rows in slices of whole groups of `group_size` rows (every argument
        holds one value per row, as score_completions checks)."""
        key = self._keys[id(func)]
        size = group_size if group_size > 0 and rows % group_size == 0 else 1  # rows of a group, else one
        groups = rows // size
        slices = min(groups, SLICES_PER_WORKER * self.n)  # more slices than workers: a slow one holds up less
        per = max(1, -(-groups // max(slices, 1))) * size  # rows a slice: whole groups
        bounds = [(a, min(a + per, rows)) for a in range(0, rows, per)] or [(0, 0)]
        tasks = [_Task(key, {k: v[a:b] for k, v in kwargs.items()}, timeout_s) for a, b in bounds]
        with self._lock:
            self._queue.extend(tasks)
            self._dispatch()
        return Pending(self, tasks)

    def call(self, func: Callable, kwargs: dict, rows: int, group_size: int, timeout_s: float | None) -> Any:
        return self.submit(func, kwargs, rows, group_size, timeout_s).result()

    def close(self) -> None:
        """End the workers (idempotent)."""
        with self._lock:
            workers, self._workers = self._workers, []
            for w in workers:
                try:
                    w.conn.close()
                except OSError:
                    pass
            for w in workers:
                w.process.join(timeout=2.0)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(timeout=2.0)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    # ------------------------------------------------------------------ internals
    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(target=_serve, args=(theirs,), daemon=True, name="grouprl-reward-worker")
        process.start()
        theirs.close()
        return _Worker(process, ours)

    def _check_loads(self) -> None:
        """Load every function in one worker now: what it cannot import fails here (ValueError), before any step."""
        w = self._workers[0]
        for key, payload in self._payloads.items():
            try:
                w.conn.send(("load", key, payload))
                kind, *rest = w.conn.recv()
            except (EOFError, OSError):
                self.close()
                raise ValueError(
                    "the reward worker processes ended as they started. If a script of yours started the run, each "
                    "worker ran its top level again (Python's multiprocessing imports the main module in a new "
                    "process): put the code that trains under `if __name__ == \"__main__\":`, or set "
                    "reward_workers: 0. The workers' own error is printed above.") from None
            if kind != "ok":
                self.close()
                raise ValueError(f"reward function {self._names[key]} cannot be loaded in a reward worker process: "
                                  f"{rest[1]}: {rest[2]} (define it at module level in an importable module, mark it "
                                  f"`in_process = True`, or set reward_workers: 0)")
            w.loaded.add(key)

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.task is None:
                task = self._queue.popleft()
                payload = None if task.key in w.loaded else self._payloads[task.key]
                w.conn.send(("call", task.key, payload, task.kwargs, task.timeout_s))
                w.loaded.add(task.key)
                w.task = task
                task.deadline = None if task.timeout_s is None else time.monotonic() + task.timeout_s + KILL_GRACE_S

    def _run_until(self, finished: Callable[[], bool]) -> None:
        with self._lock:
            while not finished():
                if not self._workers:
                    raise RuntimeError("the reward workers were closed")
                busy = [w for w in self._workers if w.task is not None]
                deadlines = [w.task.deadline for w in busy if w.task.deadline is not None]
                timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
                ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout)
                for i, w in enumerate(self._workers):
                    if w.task is None:
                        continue
                    if w.conn in ready:
                        try:
                            reply = w.conn.recv()
                        except (EOFError, OSError):
                            reply = None
                        if reply is not None:
                            self._finish(w, reply)
                            continue
                    if w.process.sentinel in ready or (w.conn in ready):
                        w.process.join(timeout=1.0)
                        code = w.process.exitcode
                        self._replace(i, ("died", f"its worker process ended during the call (exit code {code}"
                                                  f"{_signal_name(code)})"))
                    elif w.task.deadline is not None and time.monotonic() >= w.task.deadline:
                        self._replace(i, ("timeout",))
                self._dispatch()

    def _cancel(self, tasks: list[_Task]) -> None:
        with self._lock:
            for t in tasks:
                if not t.done and t in self._queue:
                    self._queue.remove(t)
                    t.reply, t.done = ("error", None, "RuntimeError", "cancelled", ""), True

    def _finish(self, w: _Worker, reply: tuple) -> None:
        task, w.task = w.task, None
        task.reply, task.done = reply, True

    def _replace(self, i: int, reply: tuple) -> None:
        """Kill worker i (stuck past its deadline, or already dead), give its task `reply`, start another."""
        w = self._workers[i]
        if w.process.is_alive():
            w.process.kill()
            logger.warning("reward function %s ran %.0f s past its timeout in a reward worker, which native code "
                           "held; the worker was killed and replaced", self._names[w.task.key], KILL_GRACE_S)
        w.process.join(timeout=2.0)
        w.conn.close()
        self._finish(w, reply)
        self._workers[i] = self._start()


def _serve(conn: Connection) -> None:
    """A worker's loop: load functions and call them (module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it ends the workers
    import torch  # combine's import

    torch.set_num_threads(1)  # a reward's tensor work must not start a thread per core in each worker
    funcs: dict[int, Callable] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if message[0] == "load":
            _, key, payload = message
            try:
                funcs[key] = _load(payload)
                conn.send(("ok",))
            except Exception as e:  # noqa: BLE001 -- named to the trainer
                conn.send(("error", None, type(e).__name__, str(e), traceback.format_exc()))
            continue
        _, key, payload, kwargs, timeout_s = message
        try:
            if payload is not None:
                funcs[key] = _load(payload)
            reply: tuple = ("ok", call_reward(funcs[key], kwargs, timeout_s))
        except RewardTimeout:
            reply = ("timeout",)
        except RewardExited as e:
            reply = ("exited", str(e))
        except BaseException as e:  # noqa: BLE001 -- the function's fault, handed to the trainer
            reply = ("error", _pickled(e), type(e).__name__, str(e), traceback.format_exc())
        try:
            try:
                conn.send(reply)
            except (OSError, EOFError):
                raise
            except Exception as e:  # noqa: BLE001 -- an output that does not pickle
                conn.send(("error", None, "TypeError", f"returned an object that cannot be sent back from the "
                           f"reward worker ({type(e).__name__}: {e}): return floats or None", ""))
        except (OSError, EOFError):  # the trainer closed the workers during the call: nobody waits for it
            return


def _payload(func: Callable, spec: Any) -> tuple[bytes | None, str]:
    """What a worker builds `func` from, or None and why it cannot go to a worker."""
    try:
        return pickle.dumps(("spec", spec) if spec is not None else ("func", func)), ""
    except Exception as e:  # noqa: BLE001 -- lambdas, closures, objects holding locks
        return None, (f"it cannot be pickled ({type(e).__name__}: {e}); define it at module level, or configure it "
                      "by name or import path")


def _load(payload: bytes) -> Callable:
    kind, what = pickle.loads(payload)
    if kind == "spec":
        from .registry import resolve_reward_spec

        return resolve_reward_spec(what)
    return what


def _pickled(e: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(e)
        pickle.loads(data)  # an exception whose __init__ takes other arguments than its args cannot be rebuilt
        return data
    except Exception:  # noqa: BLE001
        return None


def _rebuilt(data: bytes | None, type_name: str, message: str, tb: str) -> BaseException:
    """The exception a worker's function raised, as raised there where it pickles, with the worker's traceback."""
    e: BaseException = pickle.loads(data) if data is not None else RuntimeError(f"{type_name}: {message}")
    if data is None:
        e.remote_type = type_name  # type: ignore[attr-defined]
    if tb and hasattr(e, "add_note"):  # Python 3.11+
        e.add_note(f"raised in a reward worker process:\n{tb.rstrip()}")
    return e


def _joined(outs: list[Any]) -> Any:
    """The slices' outputs in row order; an output that is not a flat sequence is returned as it is, for the
    trainer's checks to name (an array of shape [n, 1], a string, a number)."""
    joined: list = []
    for out in outs:
        shape = getattr(out, "shape", None)
        if shape is not None and len(shape) > 1:
            return out
        if hasattr(out, "tolist"):
            out = out.tolist()
        if not isinstance(out, (list, tuple)):
            return out
        joined.extend(out)
    return joined


def _name(func: Callable) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    try:
        return f", {signal.Signals(-code).name}"
    except ValueError:
        return ""


def _context(preload: Sequence[str]) -> Any:
    """A fork server where the platform has one (`preload` and grouprl.rewards imported once, then frozen:
    _freeze.py), else spawn. The server is the process's; the first workers started set what it preloads."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*preload, "grouprl.rewards", "grouprl.rewards._freeze"])
        return ctx
    return mp.get_context("spawn")


__all__ = ["KILL_GRACE_S", "Pending", "RewardWorkers", "WorkerDied"]
