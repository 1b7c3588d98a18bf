"""What the sandbox tests expect of the situation they run in, and the host checks they share.

GROUPRL_TEST_SANDBOX_EXPECT names the situation; test_unprivileged.py sets it when it runs these
tests again as another uid:
- "namespace": root; namespaces and a per-run uid;
- "userns": not root, user namespaces allowed; the same walls inside a user namespace;
- "refuse": not root and no user namespaces (as under Docker's default seccomp profile): every run
  must be refused with SandboxUnavailableError, and nothing may run.
Unset: root expects "namespace", anyone else "userns".

This module and the tests that use it import only the standard library, pytest and grouprl.sandbox,
so they run under any interpreter an unprivileged uid can execute.
"""

import ctypes
import os
import signal
import time

import pytest

from grouprl.sandbox import CodeResult, SandboxUnavailableError, run_code

EXPECT = os.environ.get("GROUPRL_TEST_SANDBOX_EXPECT") or ("namespace" if os.geteuid() == 0 else "userns")
REFUSED = EXPECT == "refuse"
FAST = dict(timeout_s=1.5, memory_mb=128)  # for programs that must hit a limit: a timeout costs 1.5 s
OK = dict(timeout_s=15.0, memory_mb=128)  # for programs that must finish: a loaded CI machine must not time them out
# for programs that must hit the memory or output limit: they end there, so a long timeout costs time only if the
# limit failed, while FAST's 1.5 s timed a memory bomb out before it reached 128 MiB on a loaded machine
LIMIT = dict(timeout_s=15.0, memory_mb=128)
DOUBLE = "print(2 * int(input()))"
COUNT_CHILDREN = """
import os, time
n = 0
for _ in range(100):  # more than any process budget, and bounded where a budget failed to hold
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
print(n)
"""  # prints how many children it could start
DOUBLE_TESTS = [{"input": "3", "output": "6"}, {"input": "21\n", "output": "42\n"}]
PR_SET_CHILD_SUBREAPER = 36
# Clears its parent-death signal and leaves the launcher's process group, then waits (30 s at most,
# should the sandbox fail): what a program does to outlive its deadline.
ESCAPE = """
import ctypes, os, time
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)
os.setsid()
start = time.monotonic()
while time.monotonic() - start < 30:
    time.sleep(0.1)
"""


def sandboxed(program: str, tests: list[dict], **kwargs) -> CodeResult | None:
    """`run_code`; in the "refuse" situation, assert that it refuses and return None."""
    if REFUSED:
        with pytest.raises(SandboxUnavailableError, match="user namespaces"):
            run_code(program, tests, **kwargs)
        return None
    return run_code(program, tests, **kwargs)


def assert_normal_program_scores():
    res = sandboxed(DOUBLE, DOUBLE_TESTS + [{"input": "5", "output": "11"}], **OK)
    if not REFUSED:
        assert (res.passed, res.total, res.status, res.test_status) == (2, 3, "failed", ["passed", "passed", "failed"])


def become_subreaper() -> None:
    """Orphans of our descendants are re-parented to us, so a process that outlives a run shows up
    as our child (inside a sandbox's PID namespace its init would adopt it; when the init dies the
    kernel kills them all, and the init itself would be ours)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def live_children() -> list[int]:
    """Live processes whose parent is this process; adopted orphans that died are reaped."""
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] != me:
            continue
        if fields[0] in ("Z", "X"):  # every process we started ourselves has been waited for already
            os.waitpid(int(pid), os.WNOHANG)
        else:
            found.append(int(pid))
    return found


def outlivers(before: set[int]) -> list[int]:
    """Our live children not in `before` that are still alive after up to 2 s (SIGKILL is delivered
    asynchronously); any found are killed, so a failing test leaves nothing behind."""
    deadline = time.monotonic() + 2.0
    while set(live_children()) - before and time.monotonic() < deadline:
        time.sleep(0.02)
    left = sorted(set(live_children()) - before)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left
