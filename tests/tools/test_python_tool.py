"""The built-in `python` tool: what the model is shown, and hostile calls contained while the batch goes on.

The sandbox's walls are tested in tests/sandbox (as root and unprivileged); here each hostile call goes
through the tool and execute_calls, as the multi-turn rollout will make it, and the host is checked.
"""

import os
import socket

import pytest

from grouprl.tools import ToolCall, execute_calls, python_tool, resolve_tools
from grouprl.tools.base import truncate

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX host")


@pytest.fixture(scope="module")
def tools():
    """Limits a normal program never meets, even on a loaded machine."""
    return resolve_tools([python_tool(timeout_s=15.0, memory_mb=128, max_output_chars=200)])


@pytest.fixture(scope="module")
def fast_tools():
    """For programs that must hit the time limit."""
    return resolve_tools([python_tool(timeout_s=1.5, memory_mb=128, max_output_chars=200)])


def run(tools, *codes: str) -> list[tuple[str, str]]:
    """Each code as one row's python call, all in one batch; (status, content) per row."""
    batch = execute_calls([[ToolCall("python", {"code": c})] for c in codes], tools, timeout_s=20)
    return [(row[0].status, row[0].content) for row in batch.results]


def test_normal_code_returns_its_output(tools):
    assert run(tools, "print(sum(range(10)))", "x = 1") == [("ok", "45"), ("ok", "[no output]")]


def test_stderr_traceback_and_syntax_error(tools):
    prints_and_raises = "import sys\nprint('partial')\nsys.stderr.write('careful\\n')\nprint(1 / 0)"
    assert run(tools, prints_and_raises, "def f(:") == [
        ("ok", 'partial\nstderr:\ncareful\nTraceback (most recent call last):\n  File "solution.py", line 4, in '
               "<module>\nZeroDivisionError: division by zero"),
        ("ok", 'stderr:\n  File "solution.py", line 1\n    def f(:\n          ^\nSyntaxError: invalid syntax'),
    ]


def test_limits_are_said_plainly(fast_tools):
    assert run(fast_tools, "print('working', flush=True)\nwhile True:\n    pass",
               "a = []\nwhile True:\n    a.append(bytearray(10**7))",
               "import os\nos._exit(4)") == [
        ("ok", "working\n[timeout: stopped after 1.5 s]"),
        ("ok", 'stderr:\nTraceback (most recent call last):\n  File "solution.py", line 3, in <module>\nMemoryError\n'
               "[memory limit: the program used more than its 128 MiB]"),
        ("ok", "[error: exit code 4]"),
    ]


def test_lines_printed_before_a_timeout_are_shown(fast_tools):
    assert run(fast_tools, "import time\nprint('step 1')\ntime.sleep(60)") == [
        ("ok", "step 1\n[timeout: stopped after 1.5 s]")]


def test_a_lone_surrogate_in_the_code_is_run_not_raised(tools):
    assert run(tools, "print('fine')  # \ud800") == [("ok", "fine")]


def test_long_output_keeps_head_and_tail():
    """The line saying what was cut is paid from the budget: 52 characters cut to 40 keep 11 (5 + 6) around
    a line of 29; a budget too small for that line keeps the head alone, never more than the limit."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    assert truncate(letters, 26) == letters
    assert truncate(letters * 2, 40) == "abcde\n[... 41 characters cut ...]\nuvwxyz"
    assert truncate(letters, 10) == "abcdefghij" and truncate(letters, 1) == "a"
    for n in (8001, 8010, 8020, 10**6):
        assert len(truncate("x" * n, 8000)) == 8000
    out = resolve_tools([python_tool(timeout_s=3, max_output_chars=40)])
    assert run(out, "print('x' * 60 + 'END')") == [("ok", "xxxxx\n[... 52 characters cut ...]\nxxxEND")]


def test_hostile_calls_are_contained_and_the_next_call_works(tools, fast_tools, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-0b7e")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    read_files = (f"for p in ['/etc/passwd', {str(secret)!r}]:\n"
                  "    try:\n        print(p, 'root:' in open(p).read() or 'TOPSECRET' in open(p).read())\n"
                  "    except OSError as e:\n        print(p, type(e).__name__)")
    network = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
               "s.sendall(b'exfiltrated')\nprint('connected')")
    fork_bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    try:
        results = run(tools, read_files, network) + run(fast_tools, fork_bomb)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to the host's listener
    finally:
        server.close()
    assert results[0] == ("ok", f"/etc/passwd False\n{secret} FileNotFoundError")
    assert results[1][0] == "ok" and results[1][1].endswith("OSError: [Errno 101] Network is unreachable")
    assert results[2] == ("ok", "[timeout: stopped after 1.5 s]")
    assert run(tools, "print(6 * 7)") == [("ok", "42")]


def test_a_failure_of_the_sandbox_is_an_error_of_the_tool(monkeypatch):
    from grouprl.sandbox import ProgramResult
    from grouprl.tools import python as module

    monkeypatch.setattr(module, "run_program", lambda code, **kw: ProgramResult("sandbox_error", "", "", "no /tmp"))
    batch = execute_calls([[ToolCall("python", {"code": "print(1)"})]], resolve_tools([python_tool()]))
    assert [(r.status, r.content) for r in batch.results[0]] == [
        ("error", "error: python raised RuntimeError: the sandbox failed: no /tmp")]


def test_the_schema_the_model_sees():
    schema = python_tool().schema["function"]
    assert schema["name"] == "python"
    assert schema["description"].startswith("Run a Python program in a sandbox and return what it printed.")
    assert schema["parameters"] == {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "The complete Python program to run."}}}


def test_bad_limits():
    with pytest.raises(ValueError, match="max_output_chars=0: the model must see at least one character"):
        python_tool(max_output_chars=0)
    with pytest.raises(ValueError, match="memory_mb=4: the sandbox cannot run"):
        python_tool(memory_mb=4)
