"""Reward functions in worker processes: `RewardWorkers` (config `reward_workers: N`).

A reward written in Python runs in the trainer's process, one row after another: math-verify reads a
LaTeX answer with an antlr grammar and compares it with sympy, ~5 ms a row on a CPU, so 512 completions
take seconds of one core while the others, and on a GPU machine the GPU, wait. With N workers each
function's call on a batch is cut into slices of whole groups (the G completions of a prompt stay
together: a function may compare a completion with its group; one marked `rowwise = True`, as every
built-in is, scores each row on its own and is cut by rows), the slices run in N processes, taken in
turn as workers come free, and their outputs are joined in row order. The functions' slices all run
at once, and while they do, the trainer's process runs the functions kept there (below): a thread of
the trainer's feeds the workers and reads their answers.

What stays in the trainer's process: functions marked `in_process = True` (the reward and process
reward models: they hold a model, perhaps on the GPU; `code_tests`, whose programs already run one
per core), and functions that cannot be sent to another process (a lambda, a closure), named once in
a warning. A function configured by name or import path goes as its config entry and is built again
in each worker (a factory's closure does not pickle); a function passed as a Python object goes by
pickle (a module-level function by its import path). Every worker builds every function before it
takes a call (the time a build takes is not the call's), and the first workers do it at start, so a
function a worker cannot import fails the run before its first step, not in it. A function that keeps
state between calls, or draws random numbers, keeps it per worker (worker i is seeded `seed + i`):
mark such a function `in_process = True` to keep the trainer's behaviour (a worker that replaces one takes the
next seed, seed + n, seed + n + 1, ...).

A worker runs a function as the trainer would (`combine.call_reward`: its own timeout in its own main
thread, where math-verify's `signal.alarm` works), and sends back the output or what was raised,
validated in the trainer as any output. A worker that has not answered by the timeout plus
`KILL_GRACE_S` (native code that no signal stops) is killed and replaced: that call is a timeout. A
worker that dies (a segfault, `os._exit`, the kernel's OOM killer) is replaced and the call raises
`WorkerDied`, so the rows are retried one by one to name the row that kills it (and if every row then
succeeds, their scores are used). A worker that ends outside a call, or has not built every function
within BUILD_TIMEOUT_S, is replaced too; after MAX_FAILED_STARTS of those in a row, with no call come
back between them, the pool gives up, and every call fails with the reason. Workers ignore SIGINT and
SIGTERM (a scheduler's notice goes to every process: the trainer's stop is the trainer's to make),
leave when the trainer closes them, and are killed when the fork server exits, which it does when the
trainer's process ends, however it ends.

The workers are forked from a fork server (spawned where there is none) that imported `grouprl.rewards`
and the caller's modules once (the trainer's: Python's multiprocessing runs a script's top level again
in each worker, and its imports are then already there) and froze them out of the garbage collector: a
worker costs a fork, not a Python start, and ~5 MiB of its own until it parses. The workers read
nothing of the trainer's memory.
"""

from __future__ import annotations

import atexit
import builtins
import logging
import multiprocessing as mp
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

from .combine import RewardExited, RewardTimeout, call_reward, reward_names
from .errors import WorkerDied

logger = logging.getLogger(__name__)

KILL_GRACE_S = 3.0  # past a call's timeout: its worker is killed (its own stop had 1 s to unwind)
BUILD_TIMEOUT_S = 300.0  # a worker that has not built every function by then is killed (a build that hangs)
MAX_FAILED_STARTS = 3  # workers in a row that ended (or were killed) before a call came back: the pool gives up
SLICES_PER_WORKER = 4  # a batch's slices per worker at most, taken in turn as workers come free
_MAIN_GUARD = ("the reward worker processes ended as they started. If a script of yours started the run, each worker "
               "ran its top level again (Python's multiprocessing imports the main module in a new process): put the "
               "code that trains under `if __name__ == \"__main__\":`, or set reward_workers: 0. The workers' own "
               "error is printed above.")


@dataclass(eq=False)
class _Task:
    key: int
    kwargs: dict
    timeout_s: float | None
    done: threading.Event = field(default_factory=threading.Event)
    reply: tuple | None = None
    deadline: float | None = None


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: Connection
    loading: float | None  # until when it may build the functions (then it is killed); None once built
    task: _Task | None = None


class Pending:
    """One function's call on a batch, in flight: `result()` waits for its slices and joins them."""

    def __init__(self, pool: RewardWorkers, tasks: list[_Task]):
        self._pool, self._tasks = pool, tasks

    def cancel(self) -> None:
        """Drop the slices no worker has started (the batch failed on another function)."""
        self._pool._cancel(self._tasks)

    def result(self) -> Any:
        for t in self._tasks:
            t.done.wait()
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
                 preload: Sequence[str] = (), seed: int | None = None):
        """`funcs`: the reward and audit functions the workers may run; `specs[i]`, when given, is the
        config entry `funcs[i]` was built from, and the worker builds it from that. `preload`: modules the
        fork server imports once for every worker (the caller's: a script's top level runs again in each
        worker, and what it imports is then already there). `seed`: worker i seeds random, numpy and torch
        with seed + i once it has built its functions, so its calls draw the same numbers whatever the
        imports drew (it builds them under a seed derived from seed + i). ValueError for a function a
        worker cannot build, naming it and the fix."""
        if n < 1:
            raise ValueError(f"reward_workers={n}: give at least 1 worker process, or 0 to score in the trainer")
        self.n, self.seed = n, seed
        self._payloads: dict[int, bytes] = {}  # key -> what a worker builds the function from
        self._keys: dict[int, int] = {}  # id(func) -> key
        specs = list(specs) if specs is not None else [None] * len(funcs)
        names = dict(zip(map(id, funcs), reward_names(funcs)))  # as the scores are keyed
        for func, spec in zip(funcs, specs):
            if getattr(func, "in_process", False) or id(func) in self._keys:
                continue
            payload, why = _payload(func, spec)
            if payload is None:
                logger.warning("reward function %s runs in the trainer's process, not in the reward workers: %s",
                               names[id(func)], why)
                continue
            self._keys[id(func)] = len(self._payloads)
            self._payloads[len(self._payloads)] = payload
        self._names = {key: names[fid] for fid, key in self._keys.items()}
        self._queue: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._spawned, self._failed_starts = 0, 0  # workers started; in a row that ended before a call came back
        self._broken: str | None = None  # why no call can run any more
        self._closed, self._thread = False, None
        self._ready = threading.Event()  # the first workers built every function, or failed to
        if not self._payloads:
            logger.warning("reward_workers=%d, but every reward function runs in the trainer's process (marked "
                           "in_process, or it cannot be pickled): no worker was started", n)
            return
        self._context = _context(preload)
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)  # a submission or close() wakes the thread's wait
        start = time.perf_counter()
        self._workers = [self._spawn() for _ in range(n)]
        self._thread = threading.Thread(target=self._pump, daemon=True, name="grouprl-reward-workers")
        self._thread.start()
        # Before multiprocessing's own exit handler (atexit runs the later first), which would SIGTERM the
        # workers, who ignore it, and then wait for them for ever: a script that never closes them still ends.
        atexit.register(self.close)
        self._ready.wait()
        if self._broken is not None:
            why = self._broken
            self.close()
            raise ValueError(why)
        logger.info("reward workers: %d process%s started in %.1f s; in them: %s", n, "es" * (n > 1),
                    time.perf_counter() - start, ", ".join(self._names.values()))

    def runs(self, func: Callable) -> bool:
        """Whether `func` runs in the workers (else in the trainer's process)."""
        return id(func) in self._keys and self._thread is not None and not self._closed

    def submit(self, func: Callable, kwargs: dict, rows: int, group_size: int, timeout_s: float | None) -> Pending:
        """Start `func(**kwargs)` on `rows` rows in slices of whole groups of `group_size` rows (every argument
        holds one value per row, as score_completions checks); 1, or a function marked `rowwise = True` (it
        scores each row on its own: the built-ins), lets any row go to any worker."""
        key = self._keys[id(func)]
        whole = group_size > 0 and rows % group_size == 0 and not getattr(func, "rowwise", False)
        size = group_size if whole else 1  # rows a group, or one: a `rowwise` function's slices may cut a group
        groups = rows // size
        slices = min(groups, SLICES_PER_WORKER * self.n)  # more slices than workers: a slow one holds up less
        per = max(1, -(-groups // max(slices, 1))) * size  # rows a slice: whole groups
        bounds = [(a, min(a + per, rows)) for a in range(0, rows, per)] or [(0, 0)]
        tasks = [_Task(key, {k: v[a:b] for k, v in kwargs.items()}, timeout_s) for a, b in bounds]
        with self._lock:
            if self._broken is not None or self._closed:
                for t in tasks:
                    self._fail(t, self._broken or "the reward workers were closed")
            else:
                self._queue.extend(tasks)
                self._wake_w.send_bytes(b"x")
        return Pending(self, tasks)

    def close(self) -> None:
        """End the workers and the thread that feeds them (idempotent); calls still waiting fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._wake_w.send_bytes(b"x")
        atexit.unregister(self.close)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        with self._lock:
            workers, self._workers = self._workers, []
            for t in list(self._queue) + [w.task for w in workers if w.task is not None]:
                self._fail(t, "the reward workers were closed")
            self._queue.clear()
        for w in workers:
            w.conn.close()  # a worker waiting for a call reads the end and leaves; one in a call, after it
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=2.0)
        if self._thread is not None:
            self._wake_r.close()
            self._wake_w.close()
            self._thread = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    # ------------------------------------------------------------------ the feeding thread
    def _spawn(self) -> _Worker:
        """A new worker, sent every function to build in one message, which it reads whole before it builds
        any (so the send never waits on a build), and answers once before it takes a call."""
        ours, theirs = self._context.Pipe(duplex=True)
        seed = None if self.seed is None else self.seed + self._spawned
        self._spawned += 1
        process = self._context.Process(target=_serve, args=(theirs, seed), daemon=True, name="grouprl-reward-worker")
        process.start()
        theirs.close()
        try:
            ours.send(("load", self._payloads))
        except OSError:  # it died as it started: its sentinel says so
            pass
        return _Worker(process, ours, time.monotonic() + BUILD_TIMEOUT_S)

    def _pump(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or self._broken is not None:  # a broken pool's calls have all failed
                        return
                    self._dispatch()
                    deadlines = [w.task.deadline for w in self._workers if w.task and w.task.deadline is not None]
                    deadlines += [w.loading for w in self._workers if w.loading is not None]
                    waits = [self._wake_r] + [x for w in self._workers for x in (w.conn, w.process.sentinel)]
                timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
                ready = wait(waits, timeout)
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
                with self._lock:
                    if self._closed:
                        return
                    for i, w in enumerate(self._workers):
                        if self._broken is None:
                            self._look_at(i, w, ready)
                    if not self._ready.is_set() and all(w.loading is None for w in self._workers):
                        self._ready.set()
        except BaseException as e:  # noqa: BLE001 -- nothing may wait for ever on a thread that is gone
            with self._lock:
                self._break(f"the reward workers' feeding thread failed ({type(e).__name__}: {e})")
            logger.exception("reward workers: the feeding thread failed")

    def _break(self, why: str) -> None:
        """No call can run any more: every waiting one fails with `why`, and so will every later one."""
        self._broken = self._broken or why
        for t in list(self._queue) + [w.task for w in self._workers if w.task is not None]:
            self._fail(t, self._broken)
        for w in self._workers:
            w.task = None  # failed above: a late answer must not replace that reply
        self._queue.clear()
        self._ready.set()

    def _look_at(self, i: int, w: _Worker, ready: list) -> None:
        """Worker i's answer, its death, or its deadline."""
        message = None
        if w.conn in ready:
            try:
                message = w.conn.recv()
            except (EOFError, OSError):  # dead: its sentinel says how
                pass
            except Exception as e:  # noqa: BLE001 -- an answer that cannot be unpickled here
                message = ("error", None, type(e).__name__, f"its output could not be read back from the reward "
                           f"worker ({e}): return floats or None", "")
        if message is not None:
            self._receive(w, message)
        elif w.conn in ready or w.process.sentinel in ready:
            w.process.join(timeout=1.0)
            code = w.process.exitcode
            how = f"exit code {code}{_signal_name(code)}"
            if w.task is None:  # while it built the functions or waited for a call: nothing of a row's doing
                self._failed_start(f"{_MAIN_GUARD} ({how})" if not self._ready.is_set() else
                                   f"reward worker processes keep ending before a call comes back ({how}); the "
                                   "last worker's error is printed above")
                if self._broken is not None:
                    return
                logger.warning("a reward worker process ended outside any call (%s); it was replaced", how)
            self._replace(i, ("died", f"its worker process ended during the call ({how})"))
        elif w.loading is not None and time.monotonic() >= w.loading:
            self._failed_start(f"a reward worker did not build the reward functions within {BUILD_TIMEOUT_S:.0f} s "
                               "(one of them hangs as it is built); set reward_workers: 0 to build them here only")
            if self._broken is None:
                logger.warning("a reward worker did not build the reward functions within %.0f s; it was killed "
                               "and replaced", BUILD_TIMEOUT_S)
                self._replace(i, ("died", "its worker process was killed while building"))
        elif w.task is not None and w.task.deadline is not None and time.monotonic() >= w.task.deadline:
            logger.warning("reward function %s ran %.0f s past its timeout in a reward worker, which no signal "
                           "stopped there (native code?); the worker was killed and replaced",
                           self._names[w.task.key], KILL_GRACE_S)
            self._replace(i, ("timeout",))

    def _failed_start(self, why: str) -> None:
        """A worker ended (or was killed) with no call of its own to blame: at start the pool fails; later it
        gives up after MAX_FAILED_STARTS in a row with no call come back between them (a restart loop)."""
        self._failed_starts += 1
        if not self._ready.is_set() or self._failed_starts >= MAX_FAILED_STARTS:
            self._break(why)

    def _receive(self, w: _Worker, message: tuple) -> None:
        kind, *rest = message
        if kind == "loaded":
            w.loading = None
        elif kind == "load_error":
            key, type_name, text = rest
            self._break(f"reward function {self._names[key]} cannot be loaded in a reward worker process: "
                        f"{type_name}: {text} (define it at module level in an importable module, mark it "
                        "`in_process = True`, or set reward_workers: 0)")
        else:
            task, w.task = w.task, None
            self._failed_starts = 0  # a call came back: workers start and work
            if task is not None and not task.done.is_set():
                task.reply = message
                task.done.set()

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.task is None and w.loading is None and w.process.is_alive():
                task = self._queue.popleft()
                try:
                    w.conn.send(("call", task.key, task.kwargs, task.timeout_s))
                except OSError:  # it died idle: the task waits for another, and its sentinel gets it replaced
                    self._queue.appendleft(task)
                    continue
                except Exception as e:  # noqa: BLE001 -- arguments that cannot be pickled
                    self._fail(task, f"its arguments cannot be sent to a reward worker ({type(e).__name__}: {e})")
                    continue
                w.task = task
                task.deadline = None if task.timeout_s is None else time.monotonic() + task.timeout_s + KILL_GRACE_S

    def _replace(self, i: int, reply: tuple) -> None:
        """Kill worker i (stuck past its deadline, or already dead), give its task `reply`, start another."""
        w = self._workers[i]
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=2.0)
        w.conn.close()
        if w.task is not None and not w.task.done.is_set():
            w.task.reply = reply
            w.task.done.set()
        self._workers[i] = self._spawn()

    def _fail(self, task: _Task, why: str) -> None:
        if not task.done.is_set():
            task.reply = ("error", None, "RuntimeError", why, "")
            task.done.set()

    def _cancel(self, tasks: list[_Task]) -> None:
        with self._lock:
            for t in tasks:
                if t in self._queue:
                    self._queue.remove(t)
                    self._fail(t, "cancelled")


def _serve(conn: Connection, seed: int | None) -> None:
    """A worker's loop: build functions and call them (module docstring)."""
    for s in (signal.SIGINT, signal.SIGTERM):  # the trainer's to handle; it closes the workers
        signal.signal(s, signal.SIG_IGN)
    _drop_the_servers_lifeline()
    _die_with_parent()
    import torch  # combine's import

    torch.set_num_threads(1)  # a reward's tensor work must not start a thread per core in each worker
    if seed is not None:  # what building the functions draws (a module's import) is reproducible too,
        _seed_all(_build_seed(seed))  # from a stream of its own, apart from the calls'
    funcs: dict[int, Callable] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if message[0] == "load":
            reply: tuple = ("loaded",)
            for key, payload in message[1].items():
                try:
                    funcs[key] = _load(payload)
                except Exception as e:  # noqa: BLE001 -- named to the trainer
                    reply = ("load_error", key, type(e).__name__, str(e))
                    break
            if seed is not None:  # the one load, before any call: the calls draw from seed itself,
                _seed_all(seed)  # whatever the imports drew (a lent GPU machine's packages drew at import)
        else:
            _, key, kwargs, timeout_s = message
            try:
                reply = ("ok", call_reward(funcs[key], kwargs, timeout_s))
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


def _seed_all(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


def _build_seed(seed: int) -> int:
    """The seed a worker builds its functions under: derived from its own, and unlike seed + i of any
    other worker (those are consecutive small numbers; this is 32 bits of a hash of it)."""
    return random.Random(f"grouprl reward worker build {seed}").getrandbits(32)


def _drop_the_servers_lifeline() -> None:
    """A fork server's child inherits the write end of the pipe by which the server learns that the trainer
    is gone (it leaves at that pipe's end): a worker holding it keeps the server, and so itself, alive after
    the trainer dies. A worker starts no process, so it closes it."""
    try:
        from multiprocessing import forkserver

        fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if fd is not None:
            os.close(fd)
            forkserver._forkserver._forkserver_alive_fd = None
    except (ImportError, AttributeError, OSError):
        pass


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent, the fork server, ends; the server ends with
    the trainer's process, so a worker stuck in native code never outlives the run."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent ended before the call: nothing will kill us later
            os._exit(0)
    except (OSError, AttributeError):
        pass


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
    """The exception a worker's function raised, as raised there where it pickles (else an Exception of the
    same name and message), with the worker's traceback as a note."""
    builtin = getattr(builtins, type_name, None)
    if data is not None:
        e: BaseException = pickle.loads(data)
    elif isinstance(builtin, type) and issubclass(builtin, Exception):
        e = builtin(message)  # RuntimeError("the reward workers were closed"): catchable as such
    else:
        e = type(type_name, (Exception,), {"__module__": __name__})(message)
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
