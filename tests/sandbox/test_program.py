"""`run_program`: one run of a program in the sandbox, its stdout and stderr, and how it ended.

The walls are those of `run_code` (test_sandbox.py attacks them); here: what comes back for each way
a program can end, stdin being empty, and a hostile read contained. Runs in every situation of
situation.py (test_unprivileged.py runs it again as another uid, with and without user namespaces).
"""

import os

import pytest
from situation import EXPECT, FAST, LIMIT, OK, REFUSED

from grouprl.sandbox import ProgramResult, SandboxUnavailableError, run_program
from grouprl.sandbox import runner

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX host")


def ran(program: str, **kwargs) -> ProgramResult | None:
    """`run_program` with limits a normal program never meets; in the "refuse" situation, assert that
    it refuses."""
    if REFUSED:
        with pytest.raises(SandboxUnavailableError, match="user namespaces"):
            run_program(program, **{**OK, **kwargs})
        return None
    return run_program(program, **{**OK, **kwargs})


def test_stdout_and_stderr_come_back_with_status_ok():
    res = ran("import sys\nprint('out', 6 * 7)\nsys.stderr.write('warn\\n')\n")
    if not REFUSED:
        assert (res.status, res.stdout, res.stderr, res.detail) == ("ok", "out 42\n", "warn\n", "")
        assert res.mechanism.startswith(EXPECT) and res.duration_s > 0


def test_an_exception_gives_the_programs_traceback_without_the_harness():
    res = ran("print('before')\ndef f(n):\n    return 1 / n\nf(0)\n")
    if not REFUSED:
        assert (res.status, res.stdout, res.detail) == ("error", "before\n", "ZeroDivisionError: division by zero")
        assert res.stderr == ('Traceback (most recent call last):\n  File "solution.py", line 4, in <module>\n'
                              '  File "solution.py", line 3, in f\nZeroDivisionError: division by zero\n')


def test_stdin_is_empty():
    res = ran("print(input())")
    if not REFUSED:
        assert (res.status, res.detail) == ("error", "EOFError: EOF when reading a line")


def test_exit_status_and_syntax_error():
    res = ran("import sys\nprint('x')\nsys.exit(3)")
    if not REFUSED:
        assert (res.status, res.stdout, res.stderr, res.detail) == ("error", "x\n", "SystemExit(3)\n", "SystemExit(3)")
    res = ran("def f(:\n")
    if not REFUSED:
        assert (res.status, res.detail) == ("syntax_error", "SyntaxError: invalid syntax")


def test_limits_timeout_memory_output():
    res = ran("print('started', flush=True)\nwhile True:\n    pass\n", **FAST)
    if not REFUSED:
        assert (res.status, res.stdout, res.detail) == ("timeout", "started\n", "timeout (1.5 s wall)")
    res = ran("a = []\nwhile True:\n    a.append(bytearray(10**7))\n", **LIMIT)
    if not REFUSED:
        assert (res.status, res.detail) == ("memory_limit", "MemoryError (address space limit 128 MiB)")
    res = ran("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)\n", max_output_bytes=4096, **LIMIT)
    if not REFUSED:
        assert (res.status, res.stdout) == ("output_limit", "x" * 4096)


def test_what_was_printed_before_a_timeout_comes_back():
    """stdout is line-buffered in the sandbox: the lines written before the kill are not lost with it."""
    res = ran("import time\nfor i in range(3):\n    print('step', i)\ntime.sleep(60)\n", **FAST)
    if not REFUSED:
        assert (res.status, res.stdout) == ("timeout", "step 0\nstep 1\nstep 2\n")


def test_a_stderr_flood_stops_the_program_like_a_stdout_flood():
    res = ran("import sys\nwhile True:\n    sys.stderr.write('x' * 1000)\n", max_output_bytes=4096, **LIMIT)
    if not REFUSED:
        assert (res.status, res.stdout, res.stderr) == ("output_limit", "", "x" * 4096)


def test_a_lone_surrogate_is_a_status_not_an_exception():
    res = ran("print('fine')  # \ud800")
    if not REFUSED:
        assert (res.status, res.stdout) == ("ok", "fine\n")


def test_a_host_file_is_not_readable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-51c2")
    res = ran(f"import os\nprint(os.path.exists({str(secret)!r}), 'root:' in open('/etc/passwd').read())")
    if not REFUSED:
        assert (res.status, res.stdout) == ("ok", "False False\n")


def test_a_failure_of_the_sandbox_machinery_is_a_sandbox_error(monkeypatch):
    if REFUSED:
        return  # refused before any machinery runs (test_modes.py)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner.tempfile, "mkdtemp", no_space)
    res = run_program("print(1)", **FAST)
    assert (res.status, res.stdout, res.detail) == (
        "sandbox_error", "", "the sandbox failed: OSError: [Errno 28] No space left on device")
