"""Running parsed tool calls: `execute_calls` -> `ToolBatch` of `ToolResult`s.

Rows run concurrently, each row's calls one after another in the order the model wrote them (a
later call may rely on an earlier one's effect). A plain function runs in a daemon thread of its
own, an `async def` tool is awaited on one event loop (and so is an awaitable a plain function returns:
an `async def` behind a sync decorator); at most `max_concurrency` calls run at once.
Every call is bounded by `timeout_s`, and so is making its return value text (json, else str()),
which runs in the call's thread, or in a thread of its own after an `async def` tool. Nothing a
tool does raises here: an exception, a timeout, an unknown tool, bad arguments or a return value
that cannot be shown as text become a result whose content tells the model what went wrong, and
whose status counts it. Python cannot kill a thread: a timed-out plain function runs on, abandoned,
and cannot block interpreter exit. Abandoned calls still running are counted per tool
(`abandoned_calls`); a tool with `ABANDONED_LIMIT` of them gets no new thread (its calls are answered
with an error, once warned about) until some end, so a tool that hangs now and then cannot exhaust
the process's threads over a long run. A timed-out `async def` tool is cancelled; one that ignores
the cancellation runs on, abandoned, on the loop's daemon thread.
Limit: an `async def` tool that blocks (calls `time.sleep` or other blocking code without awaiting)
holds the event loop, so every call of the batch waits for it and no timeout fires until it yields;
make blocking work a plain function, or await it through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable

from .base import Tool, ToolCall, check_call, truncate
from .parsing import ParseError

STATUSES = ("ok", "error", "timeout", "parse_error")
ABANDONED_LIMIT = 64  # per tool: its timed-out plain-function calls still running; past it, no new thread

logger = logging.getLogger(__name__)
_abandoned: dict[str, int] = {}  # tool name -> its calls still running after their timeout
_abandoned_lock = threading.Lock()


def abandoned_calls(tool: str | None = None) -> int:
    """Timed-out calls of plain-function tools (of `tool`, else of all) still running in this process:
    threads Python cannot stop."""
    with _abandoned_lock:
        return _abandoned.get(tool, 0) if tool is not None else sum(_abandoned.values())


class _Ticket:
    """One plain-function call's thread: "running", then "done", or "abandoned" at its timeout (counted
    in `_abandoned` until the thread ends)."""

    def __init__(self, name: str):
        self.name, self.state = name, "running"

    def abandon(self) -> None:
        with _abandoned_lock:
            if self.state == "running":
                self.state = "abandoned"
                _abandoned[self.name] = _abandoned.get(self.name, 0) + 1

    def end(self) -> None:
        with _abandoned_lock:
            if self.state == "abandoned":
                _abandoned[self.name] -= 1
            self.state = "done"


@dataclass(frozen=True)
class ToolResult:
    """One call's answer. status: "ok", "error" (raised, unknown tool, bad arguments), "timeout",
    "parse_error" (the call could not be read; nothing ran)."""

    name: str | None  # the tool called; None for a call that could not be read
    content: str  # what the model is shown
    status: str
    duration_s: float = 0.0

    @property
    def message(self) -> dict:
        """The result as a chat message with role "tool"."""
        return {"role": "tool", "content": self.content} | ({"name": self.name} if self.name else {})


@dataclass(frozen=True)
class ToolBatch:
    """The results of one `execute_calls`, one list per row, in the order of the calls."""

    results: list[list[ToolResult]]
    wall_s: float  # the whole batch, start to end

    def count(self, status: str) -> int:
        """Results with this status (one of `STATUSES`)."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r}: a tool result's status is one of {', '.join(STATUSES)}")
        return sum(r.status == status for row in self.results for r in row)

    @property
    def num_calls(self) -> int:
        """Calls that were read and attempted (parse errors are not calls)."""
        return sum(r.status != "parse_error" for row in self.results for r in row)

    @property
    def tool_time_s(self) -> float:
        """Time spent in tools, summed over calls."""
        return sum(r.duration_s for row in self.results for r in row)


def execute_calls(calls: Sequence[Sequence[ToolCall | ParseError]], tools: dict[str, Tool], *,
                  timeout_s: float = 30.0, max_concurrency: int = 16, max_output_chars: int | None = None) -> ToolBatch:
    """Run each row's calls (a ParseError passes through as a "parse_error" result); see the module doc.
    `max_output_chars`: each result's content is cut to its head and tail around a line saying how
    much was cut, at most `max_output_chars` characters with the line (a tool's output is context the
    trajectory's token budget pays for); None: whole.

    The event loop runs in a thread of its own, so this works from any caller, a notebook included.
    """
    if max_output_chars is not None and max_output_chars < 1:
        raise ValueError(f"max_output_chars={max_output_chars}: the model must see at least one character")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: a tool call needs a positive time limit in seconds")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency}: at least one call must be able to run")
    start = time.monotonic()
    answer: Future = Future()

    async def run() -> None:
        # answer as soon as the rows are done: asyncio.run's teardown then awaits the cancelled tools,
        # and one that ignores its cancellation would hold the caller up until it finished
        try:
            answer.set_result(await _run_rows(calls, tools, timeout_s, max_concurrency))
        except BaseException as e:  # a bug of ours, not a tool's failure: the caller sees it
            answer.set_exception(e)

    threading.Thread(target=asyncio.run, args=(run(),), daemon=True, name="grouprl-tools").start()
    results = answer.result()
    if max_output_chars is not None:
        results = [[replace(r, content=truncate(r.content, max_output_chars)) for r in row] for row in results]
    return ToolBatch(results, time.monotonic() - start)


async def _run_rows(rows, tools, timeout_s, max_concurrency) -> list[list[ToolResult]]:
    slots = asyncio.Semaphore(max_concurrency)

    async def run_row(row: Sequence[ToolCall | ParseError]) -> list[ToolResult]:
        out = []
        for call in row:
            if isinstance(call, ParseError):
                out.append(ToolResult(None, call.message, "parse_error"))
                continue
            async with slots:
                out.append(await _run_call(call, tools, timeout_s))
        return out

    return list(await asyncio.gather(*(run_row(row) for row in rows)))


async def _run_call(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    problem = check_call(call, tools)
    if problem is not None:
        return ToolResult(call.name, f"error: {problem}", "error")
    tool = tools[call.name]
    ticket = None if tool.is_async else _Ticket(call.name)
    if ticket is not None and (held := abandoned_calls(call.name)) >= ABANDONED_LIMIT:
        _warn_once(call.name, held)
        return ToolResult(call.name, f"error: {call.name} is unavailable: {held} of its earlier calls timed out "
                          "and are still running", "error")
    start = time.monotonic()
    pending = _awaited(tool.func, call.arguments) if tool.is_async else _threaded(tool.func, call.arguments, ticket)
    task = asyncio.ensure_future(pending)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)  # not wait_for: a tool's own TimeoutError is an error
    took = time.monotonic() - start
    if not done:
        task.cancel()
        if ticket is not None:
            ticket.abandon()
        return ToolResult(call.name, f"error: {call.name} did not finish within {timeout_s:g} s", "timeout", took)
    try:
        text = task.result()
    except _Unshowable as e:
        return ToolResult(call.name, f"error: {call.name} returned a value that cannot be shown as text ({e})",
                          "error", took)
    except BaseException as e:  # even SystemExit, or a CancelledError of the tool's own
        return ToolResult(call.name, f"error: {call.name} raised {_describe(e)}", "error", took)
    return ToolResult(call.name, text, "ok", took)


_warned: set[str] = set()


def _warn_once(name: str, held: int) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning("tool %s: %d of its calls timed out and are still running (Python cannot stop a thread); its "
                       "new calls are answered with an error until some of them end. Give the tool a time limit of "
                       "its own (e.g. a network read's timeout)", name, held)


def _describe(e: BaseException) -> str:
    """"Type: message", even for an exception whose own str() raises."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 — whatever its __str__ does, the tool's error is still reported
        return f"{type(e).__name__} (its message cannot be shown)"


async def _awaited(func: Callable[..., Any], kwargs: dict) -> str:
    """An async tool's answer as text; a value that is not a string is made text in a thread, within the
    call's timeout like the call itself (a huge or slow `__str__` would otherwise hold the event loop)."""
    try:  # called inside the task, so even a call that fails to start is the task's error
        value = await func(**kwargs)
    except (SystemExit, KeyboardInterrupt) as e:  # a task re-raises these out of the event loop, ending the batch
        raise RuntimeError(repr(e)) from None
    return _shown(value) if isinstance(value, str) else await _threaded(lambda: value, {})


class _Awaitable:
    """What a plain function returned that must be awaited: an `async def` behind a sync decorator
    (functools.wraps copies its name, not its being a coroutine function) returns a coroutine."""

    def __init__(self, awaitable: Any):
        self.awaitable = awaitable

    def close(self) -> None:
        """A coroutine never to be awaited (its call timed out) is closed, lest it warn "never awaited"."""
        if inspect.iscoroutine(self.awaitable):
            self.awaitable.close()


async def _threaded(func: Callable[..., Any], kwargs: dict, ticket: _Ticket | None = None) -> str:
    """`func(**kwargs)` as text, run in a daemon thread; an awaitable it returns is awaited on the loop, like
    an `async def` tool's call, within the same timeout."""
    value = await _in_daemon_thread(func, kwargs, ticket)
    return await _awaited(lambda: value.awaitable, {}) if isinstance(value, _Awaitable) else value


def _in_daemon_thread(func: Callable[..., Any], kwargs: dict, ticket: _Ticket | None = None) -> asyncio.Future:
    """`func(**kwargs)`, made text (or an `_Awaitable` to be awaited on the loop), in a new daemon thread (so
    the call's timeout bounds both); the future settles on the calling loop. `ticket` is ended when the
    thread is."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # a timed-out call's future was cancelled
            if isinstance(value, _Awaitable):
                value.close()
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value = func(**kwargs)
            value, error = _Awaitable(value) if inspect.isawaitable(value) else _shown(value), None
        except BaseException as e:  # even SystemExit: a tool never takes the trainer down
            # a Future refuses StopIteration (it would end a generator), so it travels wrapped like SystemExit
            wrap = not isinstance(e, Exception) or isinstance(e, StopIteration)
            value, error = None, RuntimeError(repr(e)) if wrap else e
        finally:
            if ticket is not None:
                ticket.end()
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop has closed: this call timed out and was abandoned
            if isinstance(value, _Awaitable):
                value.close()  # never to be awaited: closed, lest it warn "never awaited"

    threading.Thread(target=target, daemon=True, name=f"tool-{getattr(func, '__name__', 'func')}").start()
    return future


class _Unshowable(Exception):
    """A tool's return value that `_as_text` could not make text; the message says why."""


def _shown(value: Any) -> str:
    try:
        return _as_text(value)
    except Exception as e:  # e.g. nesting too deep for json, or an object whose __str__ raises
        raise _Unshowable(_describe(e)) from None


def _as_text(value: Any) -> str:
    """A tool's return value as the model sees it: a string as is, anything else as JSON (else str()),
    non-ASCII characters as themselves (not \\u escapes, which cost tokens and hide the text);
    characters UTF-8 cannot encode (lone surrogates, as `os.listdir` gives for a file name that is not
    UTF-8) as "?", since the tokenizer refuses them."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            value = str(value)
    return value.encode("utf-8", "replace").decode("utf-8") if not value.isascii() else value
