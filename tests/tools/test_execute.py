"""execute_calls: rows run concurrently; a tool that raises, hangs, is unknown or gets bad arguments
answers with an error and never raises; async tools are awaited; the counts add up."""

import asyncio
import functools
import gc
import threading
import time
import warnings

import pytest

from grouprl.tools import ParseError, ToolCall, ToolResult, execute_calls, resolve_tools

from .conftest import add

RELEASE = threading.Event()  # set at the end of the module: lets the abandoned hanging threads finish


def divide(a: float, b: float) -> float:
    """Divide.

    Args:
        a: Numerator.
        b: Denominator.
    """
    return a / b


def hang(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: How long to wait.
    """
    RELEASE.wait(seconds)
    return "woke up"


async def slow_echo(text: str, delay: float) -> dict:
    """Echo after a delay.

    Args:
        text: What to echo.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return {"echo": text}


def leave(code: int) -> str:
    """Exit the interpreter.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


def timeout_inside() -> str:
    """Fail with the tool's own TimeoutError.
    """
    raise TimeoutError("upstream did not answer")


TOOLS = resolve_tools([add, divide, hang, slow_echo, leave, timeout_inside])


@pytest.fixture(scope="module", autouse=True)
def release_hanging_threads():
    yield
    RELEASE.set()


def test_ok_error_timeout_async_in_one_batch():
    calls = [
        [ToolCall("add", {"a": 2, "b": 3}), ToolCall("divide", {"a": 1, "b": 0})],
        [ToolCall("hang", {"seconds": 60}), ToolCall("add", {"a": 1})],
        [ToolCall("slow_echo", {"text": "hi", "delay": 0.2})],
        [ToolCall("slow_echo", {"text": "late", "delay": 60})],
    ]
    start = time.monotonic()
    batch = execute_calls(calls, TOOLS, timeout_s=2.0)
    took = time.monotonic() - start
    assert [[(r.name, r.content, r.status) for r in row] for row in batch.results] == [
        [("add", "5", "ok"), ("divide", "error: divide raised ZeroDivisionError: division by zero", "error")],
        [("hang", "error: hang did not finish within 2 s", "timeout"), ("add", "1", "ok")],
        [("slow_echo", '{"echo": "hi"}', "ok")],
        [("slow_echo", "error: slow_echo did not finish within 2 s", "timeout")],
    ]
    assert (batch.num_calls, batch.count("ok"), batch.count("error"), batch.count("timeout")) == (6, 3, 1, 2)
    timed_out = [r.duration_s for row in batch.results for r in row if r.status == "timeout"]
    assert all(d >= 2.0 for d in timed_out) and took >= 2.0, (timed_out, took)  # each waited its whole timeout
    # rows ran concurrently: the two timeouts overlap, so the batch took less than their sum (one after
    # the other it takes at least the sum; no bound on a busy machine's clock)
    assert batch.wall_s < sum(timed_out), (batch.wall_s, timed_out)
    assert batch.tool_time_s >= sum(timed_out) + 0.2 and batch.wall_s >= took - 0.05


def test_calls_within_a_row_run_in_order():
    seen = []

    def record(tag: str) -> str:
        """Record a tag.

        Args:
            tag: The tag.
        """
        time.sleep(0.05 if tag == "first" else 0)
        seen.append(tag)
        return tag

    batch = execute_calls([[ToolCall("record", {"tag": "first"}), ToolCall("record", {"tag": "second"})]],
                          resolve_tools([record]))
    assert seen == ["first", "second"] and [r.content for r in batch.results[0]] == ["first", "second"]


def test_max_concurrency_bounds_the_calls_running_at_once():
    """Counted, not timed: with 3 slots the 3 calls meet at a barrier (they run at once); with 1 slot
    no two ever run together."""
    running, most = [0], [0]
    lock, barrier = threading.Lock(), threading.Barrier(3)

    def meet(i: int, parties: int) -> str:
        """Run beside the others.

        Args:
            i: Which call.
            parties: How many wait for each other (1: none).
        """
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        if parties > 1:
            barrier.wait(timeout=20)  # broken (an error result) unless all of them run at once
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return str(i)

    tools = resolve_tools([meet])
    together = execute_calls([[ToolCall("meet", {"i": i, "parties": 3})] for i in range(3)], tools, max_concurrency=3)
    assert [row[0].status for row in together.results] == ["ok"] * 3 and most[0] == 3
    most[0] = 0
    alone = execute_calls([[ToolCall("meet", {"i": i, "parties": 1})] for i in range(3)], tools, max_concurrency=1)
    assert [row[0].content for row in alone.results] == ["0", "1", "2"] and most[0] == 1


def test_unknown_tool_bad_arguments_and_parse_errors_never_raise():
    bad = ParseError("invalid JSON (Expecting value at line 1 column 1)", "<tool_call>x</tool_call>")
    batch = execute_calls([[ToolCall("mul", {"a": 1}), ToolCall("add", {"x": 1}), bad], []], TOOLS)
    assert [(r.name, r.content, r.status) for r in batch.results[0]] == [
        ("mul", "error: unknown tool 'mul'; the tools are: add, divide, hang, leave, slow_echo, timeout_inside",
         "error"),
        ("add", "error: bad arguments for add: missing 'a'; unexpected 'x'. It takes (a: integer, b: integer "
                "(optional))", "error"),
        (None, "error: could not read this tool call: invalid JSON (Expecting value at line 1 column 1).",
         "parse_error"),
    ]
    assert batch.results[1] == []
    assert (batch.num_calls, batch.count("error"), batch.count("parse_error")) == (2, 2, 1)


def test_system_exit_and_a_tools_own_timeout_error_are_errors():
    batch = execute_calls([[ToolCall("leave", {"code": 3})], [ToolCall("timeout_inside", {})]], TOOLS, timeout_s=5)
    assert [(r.content, r.status) for row in batch.results for r in row] == [
        ("error: leave raised RuntimeError: SystemExit(3)", "error"),
        ("error: timeout_inside raised TimeoutError: upstream did not answer", "error"),
    ]


async def leave_async(code: int) -> str:
    """Exit the interpreter, from a coroutine.

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


async def interrupt() -> str:
    """Interrupt, from a coroutine.
    """
    raise KeyboardInterrupt


def stop() -> str:
    """Raise StopIteration, which an asyncio future refuses to carry.
    """
    raise StopIteration("done")


def test_system_exit_keyboard_interrupt_and_stop_iteration_are_errors_at_once():
    """An asyncio task re-raises SystemExit and KeyboardInterrupt out of the loop, and a future refuses
    StopIteration: each must still come back as the tool's error, not the timeout (whose status is
    "timeout": a StopIteration never settled its future and waited for it)."""
    batch = execute_calls([[ToolCall("leave_async", {"code": 3})], [ToolCall("interrupt", {})],
                           [ToolCall("stop", {})]], resolve_tools([leave_async, interrupt, stop]), timeout_s=5)
    assert [(r.content, r.status) for row in batch.results for r in row] == [
        ("error: leave_async raised RuntimeError: SystemExit(3)", "error"),
        ("error: interrupt raised RuntimeError: KeyboardInterrupt()", "error"),
        ("error: stop raised RuntimeError: StopIteration('done')", "error"),
    ]


class Unprintable:
    def __str__(self):
        raise RuntimeError("no str")


def nested(depth: int) -> list:
    """A list nested `depth` deep.

    Args:
        depth: How deep.
    """
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def unprintable() -> str:
    """Return an object that cannot be made text.
    """
    return Unprintable()


def test_a_return_value_that_cannot_be_shown_as_text_is_an_error():
    batch = execute_calls([[ToolCall("nested", {"depth": 100_000})], [ToolCall("unprintable", {})]],
                          resolve_tools([nested, unprintable]))
    (deep,), (bad,) = batch.results
    assert deep.status == "error" and deep.content.startswith(
        "error: nested returned a value that cannot be shown as text (RecursionError: ")
    assert (bad.content, bad.status) == (
        "error: unprintable returned a value that cannot be shown as text (RuntimeError: no str)", "error")


class Unspeakable(Exception):
    def __str__(self):
        raise RuntimeError("no message either")


def speechless() -> str:
    """Fail with an exception whose message cannot be made text.
    """
    raise Unspeakable


def listing() -> list:
    """A directory listing with a file name that is not UTF-8, as os.listdir decodes it (surrogateescape).
    """
    return b"caf\xe9.txt".decode("utf-8", "surrogateescape")


def listings() -> dict:
    """Directory listings: a UTF-8 file name, and one that is not (surrogateescape).
    """
    return {"here": ["Zürich −3 °C.txt"], "there": [listing()]}


def test_an_error_without_a_message_and_a_name_utf8_cannot_encode_are_still_answers():
    batch = execute_calls([[ToolCall("speechless", {})], [ToolCall("listing", {})], [ToolCall("listings", {})]],
                          resolve_tools([speechless, listing, listings]))
    (silent,), (names,), (shown,) = batch.results
    assert (silent.content, silent.status) == (
        "error: speechless raised Unspeakable (its message cannot be shown)", "error")
    assert (names.content, names.status) == ("caf?.txt", "ok")  # the tokenizer refuses a lone surrogate
    names.content.encode("utf-8")
    # JSON shows non-ASCII as itself, not as \u escapes the model would have to decode
    assert (shown.content, shown.status) == ('{"here": ["Zürich −3 °C.txt"], "there": ["caf?.txt"]}', "ok")


LET_GO, STUBBORN_DONE = threading.Event(), threading.Event()  # the stubborn tool's release, and its end


async def stubborn(seconds: float) -> str:
    """Ignore cancellation until let go or `seconds` have passed.

    Args:
        seconds: How long to hold out.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end and not LET_GO.is_set() and not RELEASE.is_set():
        try:
            await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            pass
    STUBBORN_DONE.set()
    return "finally"


def test_an_async_tool_that_ignores_cancellation_does_not_hold_up_the_batch():
    """The batch answers at the timeout while the tool, which ignores its cancellation, still runs
    (abandoned): the order of the two events is asserted, not a duration."""
    batch = execute_calls([[ToolCall("stubborn", {"seconds": 60})]], resolve_tools([stubborn]), timeout_s=0.5)
    still_running = not STUBBORN_DONE.is_set()
    LET_GO.set()
    assert [(r.content, r.status) for r in batch.results[0]] == [
        ("error: stubborn did not finish within 0.5 s", "timeout")]
    assert still_running  # the batch came back before the tool ended
    assert STUBBORN_DONE.wait(30)  # once let go, the abandoned tool ends


def logged(func):
    """A sync decorator: functools.wraps copies an `async def`'s name and docstring, not its being one."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


decorated_echo = logged(slow_echo)  # named slow_echo, as wraps copies the name


def test_an_async_tool_behind_a_sync_decorator_is_awaited_within_the_timeout():
    tools = resolve_tools([decorated_echo])
    assert not tools["slow_echo"].is_async  # what it returns tells, not what it is
    batch = execute_calls([[ToolCall("slow_echo", {"text": "x", "delay": 0})],
                           [ToolCall("slow_echo", {"text": "y", "delay": 60})]], tools, timeout_s=0.5)
    assert [(r.content, r.status) for row in batch.results for r in row] == [
        ('{"echo": "x"}', "ok"), ("error: slow_echo did not finish within 0.5 s", "timeout")]


async def _late_result():
    return "x"


def late_coroutine(delay: float) -> str:
    """Return a coroutine after `delay` seconds.

    Args:
        delay: seconds
    """
    time.sleep(delay)
    return _late_result()


def test_a_coroutine_a_timed_out_tool_returns_after_the_batch_is_closed_without_a_warning():
    """The batch's loop is closed when the thread comes back with it: nothing will await it, and left
    unclosed it warned "coroutine ... was never awaited" when collected."""
    tools = resolve_tools([late_coroutine])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        batch = execute_calls([[ToolCall("late_coroutine", {"delay": 0.3})]], tools, timeout_s=0.05)
        time.sleep(0.6)  # the thread ends, after the batch's loop has closed
        gc.collect()
    assert batch.results[0][0].status == "timeout"
    assert not [w for w in seen if "never awaited" in str(w.message)]


def test_results_as_tool_messages():
    assert ToolResult("add", "5", "ok").message == {"role": "tool", "content": "5", "name": "add"}
    assert ToolResult(None, "error: x", "parse_error").message == {"role": "tool", "content": "error: x"}


def test_works_inside_a_running_event_loop():
    async def caller():
        return execute_calls([[ToolCall("slow_echo", {"text": "x", "delay": 0})]], TOOLS)

    assert asyncio.run(caller()).results[0][0].content == '{"echo": "x"}'


def shout(n: int) -> str:
    """Write n characters.

    Args:
        n: how many
    """
    return "".join(chr(ord("a") + i % 26) for i in range(n))


def test_long_results_are_cut_to_their_head_and_tail():
    """max_output_chars 40: 100 characters become their first 5 and last 6 around a line of 29 counting
    the 89 cut, 40 in all; a result that fits, and an error message, are cut the same way or kept whole."""
    tools = resolve_tools([shout, divide])
    batch = execute_calls([[ToolCall("shout", {"n": 100}), ToolCall("shout", {"n": 40})],
                           [ToolCall("divide", {"a": 1, "b": 0})]], tools, max_output_chars=40)
    (long, short), (error,) = batch.results
    assert long.content == "abcde\n[... 89 characters cut ...]\nqrstuv" and long.status == "ok"
    assert short.content == shout(40)
    assert error.status == "error" and len(error.content) == 40 and "characters cut" in error.content
    assert execute_calls([[ToolCall("shout", {"n": 30})]], tools).results[0][0].content == shout(30)  # None: whole


def test_bad_limits():
    with pytest.raises(ValueError, match="timeout_s=0: a tool call needs a positive time limit in seconds"):
        execute_calls([], TOOLS, timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency=0: at least one call must be able to run"):
        execute_calls([], TOOLS, max_concurrency=0)
    with pytest.raises(ValueError, match="max_output_chars=0: the model must see at least one character"):
        execute_calls([], TOOLS, max_output_chars=0)
    with pytest.raises(ValueError, match="status 'timed_out': a tool result's status is one of ok, error, timeout, "
                                         "parse_error"):
        execute_calls([], TOOLS).count("timed_out")


class SlowToShow:
    """A value whose text takes longer than the call's timeout (json refuses it, so str() is used)."""

    def __str__(self):
        RELEASE.wait(60)
        return "shown at last"


def slow_to_show() -> object:
    """Return at once a value that is slow to make text.
    """
    return SlowToShow()


async def slow_to_show_async() -> object:
    """The same, from an async tool.
    """
    return SlowToShow()


def test_making_the_answer_text_is_within_the_timeout():
    """A tool that returns at once a value whose str() hangs times out like a tool that hangs, sync or
    async, and the batch answers while that conversion still runs (abandoned)."""
    batch = execute_calls([[ToolCall("slow_to_show", {})], [ToolCall("slow_to_show_async", {})],
                           [ToolCall("add", {"a": 1, "b": 2})]],
                          resolve_tools([slow_to_show, slow_to_show_async, add]), timeout_s=2)
    assert [(r.content, r.status) for row in batch.results for r in row] == [
        ("error: slow_to_show did not finish within 2 s", "timeout"),
        ("error: slow_to_show_async did not finish within 2 s", "timeout"), ("3", "ok")]


def test_a_tool_whose_timed_out_calls_pile_up_gets_no_new_threads(monkeypatch, caplog):
    """Python cannot stop a timed-out plain-function call: its thread runs on. A tool that hangs now and
    then would pile such threads up over a long run until the process could start no more. Past
    ABANDONED_LIMIT calls still running, its calls are answered with an error without a thread (warned
    once); the other tools run as before, and once the hung calls end, the tool runs again."""
    import grouprl.tools.execute as execute

    gate = threading.Event()

    def stuck(n: int) -> str:
        """Wait for the gate.

        Args:
            n: Any number.
        """
        gate.wait(60)
        return f"through {n}"

    tools = resolve_tools([stuck, add])
    monkeypatch.setattr(execute, "ABANDONED_LIMIT", 3)
    threads = lambda: sum(t.name == "tool-stuck" for t in threading.enumerate())  # noqa: E731
    with caplog.at_level("WARNING", logger="grouprl.tools.execute"):
        first = execute_calls([[ToolCall("stuck", {"n": i})] for i in range(3)], tools, timeout_s=0.05)
        assert [r[0].status for r in first.results] == ["timeout"] * 3
        assert execute.abandoned_calls("stuck") == 3 and threads() == 3
        later = execute_calls([[ToolCall("stuck", {"n": 9}), ToolCall("add", {"a": 1, "b": 2})]] * 2, tools,
                              timeout_s=0.05)
    for row in later.results:
        assert row[0].status == "error" and "3 of its earlier calls timed out and are still running" in row[0].content
        assert (row[1].status, row[1].content) == ("ok", "3")
    assert threads() == 3  # no thread started for the refused calls
    from grouprl.rollout.types import trajectory_metrics

    gauge = trajectory_metrics({"tool_calls": 6.0, "trajectories": 2.0})["multiturn/tool_calls_abandoned"]
    assert gauge == execute.abandoned_calls() >= 3  # the process's count (other tests' hung calls included)
    assert caplog.text.count("tool stuck: 3 of its calls timed out and are still running") == 1
    gate.set()
    for _ in range(600):  # the hung calls end: nothing is abandoned any more
        if execute.abandoned_calls("stuck") == 0:
            break
        time.sleep(0.1)
    assert execute.abandoned_calls("stuck") == 0
    again = execute_calls([[ToolCall("stuck", {"n": 1})]], tools, timeout_s=30)
    assert (again.results[0][0].status, again.results[0][0].content) == ("ok", "through 1")
