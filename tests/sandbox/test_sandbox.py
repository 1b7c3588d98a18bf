"""The code sandbox: correct scoring, and containment of hostile programs.

Each hostile program attacks the host and prints what it got; the test checks the host afterwards
(files, processes, our own listener, our environment), that the call returned a failing CodeResult,
and that a normal program scored right after is scored correctly. Every test here runs in three
situations (situation.py): as root, as an unprivileged uid with user namespaces, and as an
unprivileged uid without them, where every run must be refused and nothing may happen to the host.
The conftest checks after each test that no process outlived it.
"""

import contextlib
import os
import platform
import socket
import threading
import time

import pytest
from situation import (COUNT_CHILDREN, DOUBLE, DOUBLE_TESTS, ESCAPE, EXPECT, FAST, LIMIT, OK, REFUSED,
                       assert_normal_program_scores, live_children, outlivers, sandboxed)

from grouprl.sandbox import CodeResult, SandboxUnavailableError, check_memory, run_code_batch, sandbox_mechanism
from grouprl.sandbox import launch, process
from grouprl.sandbox import runner as sandbox

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX host")
MINIMAL_ROOT = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin", "tmp", "usr"}


@pytest.fixture
def used_uids(monkeypatch):
    """The per-run uids claimed during the test, when root (other test processes may run sandboxes)."""
    uids = []
    claim = sandbox.claim_uid

    @contextlib.contextmanager
    def recording_claim(per_run=True):
        with claim(per_run) as uid:
            uids.append(uid)
            yield uid

    monkeypatch.setattr(sandbox, "claim_uid", recording_claim)
    return uids


def live_processes(uids) -> list[int]:
    """Pids of live processes running under any of `uids` (0, "no per-run uid", is never counted)."""
    wanted = set(uids) - {0}
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and process.live_uid(p) in wanted]


# ---------------------------------------------------------------- scoring


def test_stdin_stdout_tests_count_and_compare_after_stripping_trailing_whitespace():
    res = sandboxed("n = int(input())\nprint(n * 2, '  ')\nprint()\n", DOUBLE_TESTS, **OK)
    if not REFUSED:
        assert isinstance(res, CodeResult)
        assert (res.passed, res.total, res.status) == (2, 2, "passed")
        assert res.fraction == 1.0
        assert res.mechanism.startswith(EXPECT)


def test_wrong_answer_is_failed_with_a_readable_detail():
    res = sandboxed("print(7)", [{"input": "", "output": "6"}], **OK)
    if not REFUSED:
        assert (res.passed, res.status) == (0, "failed")
        assert "expected '6', got '7'" in res.detail


def test_only_newlines_and_trailing_spaces_tabs_and_carriage_returns_are_layout():
    cases = [("1 \t\r\n2\r\n\n", "1\n2", "passed"), ("1\x0c2", "1\n2", "failed"), ("1\x1c2", "1\n2", "failed"),
             ("1\u20282", "1\n2", "failed"), ("42\u00a0", "42", "failed")]
    for out, expected, status in cases:
        res = sandboxed(f"import sys\nsys.stdout.write({out!r})", [{"input": "", "output": expected}], **OK)
        if not REFUSED:
            assert res.status == status, (out, res.detail)


def test_output_up_to_the_cap_is_scored_and_one_byte_more_is_not():
    for n, status in ((4096, "passed"), (4097, "output_limit")):
        res = sandboxed(f"print('a' * {n}, end='')", [{"input": "", "output": "a" * n}], max_output_bytes=4096, **OK)
        if not REFUSED:
            assert res.status == status, (n, res.detail)


def test_stdin_is_a_pipe_that_carries_a_large_input_read_or_not():
    """Not a host file, which a program could reopen for writing where it runs as the file's owner."""
    big = "7" * 300_000
    prog = "import os, stat, sys\nprint(stat.S_ISFIFO(os.fstat(0).st_mode), len(sys.stdin.read()))"
    res = sandboxed(prog, [{"input": big, "output": "True 300000"}, {"input": "", "output": "True 0"}], **OK)
    if not REFUSED:
        assert res.test_status == ["passed", "passed"], res.detail
    res = sandboxed("print(1)", [{"input": big, "output": "1"}], **OK)  # never reads it
    if not REFUSED:
        assert res.status == "passed", res.detail


def test_a_lone_surrogate_in_the_program_or_a_test_is_scored_not_raised():
    res = sandboxed("print(len(input()))  # \ud800", [{"input": "a\ud800b", "output": "3"},
                                                       {"input": "ab", "output": "\ud800"}], **OK)
    if not REFUSED:
        assert res.test_status == ["passed", "failed"], res.detail


def test_assert_tests_run_in_the_program_namespace():
    prog = "def add(a, b):\n    return a + b\n"
    tests = [{"assert": "assert add(1, 2) == 3"}, {"assert": "assert add(2, 2) == 5"},
             {"assert": "assert add(0, 0) == 0"}]
    res = sandboxed(prog, tests, **OK)
    if not REFUSED:
        assert (res.passed, res.total, res.test_status) == (2, 3, ["passed", "failed", "passed"])


def test_a_test_that_is_one_expression_fails_when_false():
    """`{"assert": "add(2, 2) == 5"}` without the keyword: its value decides (it passed before, whatever the
    program did); a value of None is a call made for its effect (HumanEval's check(f) raises on failure)."""
    prog = "def add(a, b):\n    return a + b\ndef check(f):\n    assert f(1, 1) == 2\n"
    tests = [{"assert": "add(1, 2) == 3"}, {"assert": "add(2, 2) == 5"}, {"assert": "[]"}, {"assert": "check(add)"},
             {"assert": "add(1, 2) == 3 and add(2, 2)"}]
    res = sandboxed(prog, tests, **OK)
    if not REFUSED:
        assert res.test_status == ["passed", "failed", "failed", "passed", "passed"], res.detail
        assert "the test 'add(2, 2) == 5' is False" in res.detail


@pytest.mark.parametrize("leave", ["import os\nos._exit(0)", "import sys\nsys.exit(0)", "exit()"])
def test_leaving_early_does_not_pass_an_assert_test(leave):
    res = sandboxed(leave, [{"assert": "assert False"}], **OK)
    if not REFUSED:
        assert res.passed == 0 and res.status in ("failed", "error")


def test_runtime_error_and_syntax_error():
    res = sandboxed("raise KeyError('boom')", DOUBLE_TESTS, **OK)
    if not REFUSED:
        assert (res.passed, res.status) == (0, "error") and "KeyError" in res.detail
    res = sandboxed("def f(:\n", DOUBLE_TESTS, **OK)
    if not REFUSED:
        assert (res.status, res.test_status) == ("syntax_error", ["syntax_error", "not_run"])


def test_exit_codes_and_text_a_program_controls_decide_no_status_of_ours():
    """sandbox_error comes from a private pipe, syntax_error, memory_limit and the CPU limit from the harness's
    verdict (sealed with a nonce): a program faking them is an error, and its remaining tests still run."""
    fakes = ["import os, sys\nsys.stderr.write('sandbox setup failed: fake\\n')\nsys.stderr.flush()\nos._exit(125)",
             "import os\nos._exit(3)", "import os\nos._exit(124)",
             "import sys\nsys.stderr.write('MemoryError\\n')\nsys.exit(1)"]
    for prog in fakes:
        res = sandboxed(prog, DOUBLE_TESTS, **OK)
        if not REFUSED:
            assert (res.status, res.test_status) == ("error", ["error", "error"]), (prog, res.detail)


def test_the_cpu_limit_is_a_timeout(monkeypatch):
    monkeypatch.setattr(sandbox, "_cpu_s", lambda timeout_s: 1)  # 1 s of CPU within a 15 s deadline
    res = sandboxed("while True:\n    pass\n", DOUBLE_TESTS, **OK)
    if not REFUSED:
        assert (res.status, res.test_status) == ("timeout", ["timeout", "not_run"])
        assert res.detail == "test 0: CPU limit (1 s)"


def test_too_little_memory_for_the_interpreter_is_a_sandbox_error_not_a_zero():
    res = sandboxed(DOUBLE, DOUBLE_TESTS, timeout_s=15.0, memory_mb=4)
    if not REFUSED:
        assert (res.status, res.test_status) == ("sandbox_error", ["sandbox_error", "not_run"]), res.detail
    if REFUSED:
        with pytest.raises(SandboxUnavailableError):
            check_memory(4)
        return
    with pytest.raises(ValueError, match="memory_mb=4: the sandbox cannot run print"):
        check_memory(4)
    check_memory(128)


def test_no_tests_and_malformed_tests():
    from grouprl.sandbox import run_code

    assert run_code("print(1)", []).status == "no_tests"  # decided before any sandbox is needed
    with pytest.raises(ValueError, match="test 0"):
        run_code("print(1)", [{"stdin": "1"}])


def test_batch_runs_in_parallel_and_keeps_order():
    programs = [f"print({k} * int(input()))" for k in range(6)]
    tests = [[{"input": "7", "output": str(7 * k)}] for k in range(6)]
    with pytest.raises(ValueError, match="one test list per program"):
        run_code_batch(programs, tests[:2])
    if REFUSED:
        with pytest.raises(sandbox.SandboxUnavailableError):
            run_code_batch(programs, tests, **OK)
        return
    results = run_code_batch(programs, tests, **OK)
    assert [r.passed for r in results] == [1] * 6


# ---------------------------------------------------------------- hostile programs


def test_read_host_files_passwd_and_the_callers_secrets(tmp_path):
    secret = tmp_path / "secret.txt"  # under /tmp, owned by the caller, readable by the caller only
    secret.write_text("TOPSECRET-7f3a")
    secret.chmod(0o600)
    paths = ["/etc/passwd", "/etc/shadow", str(secret), os.path.abspath(__file__),
             os.path.expanduser("~/.bashrc"), "../../etc/passwd", "/proc/1/environ"]
    prog = f"""
import os
seen = []
for path in {paths!r}:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError as e:
        continue
    if "TOPSECRET" in text or "root:" in text or "hostile programs" in text:
        seen.append(path + ": " + text[:40])
print("leaked " + " | ".join(seen) if seen else "contained")
"""
    res = sandboxed(prog, [{"input": "", "output": "contained"}], **OK)
    if not REFUSED:
        assert (res.status, res.passed) == ("passed", 1), res.detail
        assert "TOPSECRET" not in res.detail
    assert_normal_program_scores()


def test_the_host_tree_is_not_there():
    """Only the minimal read-only view: no /home, /root's files, /work, /var, /opt, /srv of the host."""
    if REFUSED:
        sandboxed("print(1)", [{"input": "", "output": "1"}], **OK)
        return
    mech = sandbox_mechanism()
    # the interpreter's installation is visible (read-only) wherever it lives, e.g. /root/.pyenv/...
    allowed = MINIMAL_ROOT | {os.path.realpath(mech.python).split("/")[1]}
    prog = "import os\nprint(' '.join(sorted(os.listdir('/'))))\n"
    res = sandboxed(prog, [{"input": "", "output": "x"}], **OK)
    got = set(res.detail.split("got '")[1].rstrip("'").split())
    assert got <= allowed and {"tmp", "usr", "sandbox"} <= got, got


SHM = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(0, ctypes.c_size_t(1 << 20), 0o1600) >= 0)
"""


MEMFD = """import os
try:
    fd = os.memfd_create("hold")
except PermissionError:
    print("refused")
else:
    for _ in range(200):
        os.write(fd, bytes(1 << 20))
    print("held", os.fstat(fd).st_size >> 20, "MiB")
"""


def test_sysv_shared_memory_and_memfd_files_which_the_memory_limit_does_not_count_are_off():
    """A SysV segment written and then detached is not in the address space RLIMIT_AS bounds: 300 MiB were
    held under a 64 MiB memory_mb; nor is a memfd file (200 MiB under 128, one per open file, in each
    process). Both are refused by the launcher's seccomp filter, as root and in a user namespace (on the
    machines SECCOMP_ARCH lists); as root the run's IPC namespace also has shmget's limits at 0."""
    filtered = platform.machine() in launch.SECCOMP_ARCH
    allowed = "True" if EXPECT == "userns" and not filtered else "False"
    res = sandboxed(SHM, [{"input": "", "output": allowed}], **OK)
    if res is not None:  # None: the run was refused, which sandboxed checked
        assert res.passed == 1, res.detail
    res = sandboxed(MEMFD, [{"input": "", "output": "refused" if filtered else "held 200 MiB"}], **OK)
    if res is not None:
        assert res.passed == 1, res.detail


def test_write_outside_the_sandbox_directory(tmp_path):
    tag = os.urandom(4).hex()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # even a world-writable host directory must stay untouched
    targets = [f"/tmp/grouprl-pwned-{tag}", f"/var/tmp/grouprl-pwned-{tag}", f"/dev/shm/grouprl-pwned-{tag}",
               f"/etc/grouprl-pwned-{tag}", f"/usr/grouprl-pwned-{tag}", str(open_dir / "pwned"),
               f"../pwned-{tag}", "/sandbox/program.py"]
    prog = f"""
wrote = []
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        wrote.append(path)
    except OSError:
        pass
print("wrote", len(wrote))
"""
    res = sandboxed(prog, [{"input": "", "output": f"wrote {len(targets)}"}], **OK)
    if not REFUSED:
        assert res.status == "failed"
    for path in targets[:-2]:
        assert not os.path.exists(path), path
    assert list(open_dir.iterdir()) == []
    assert_normal_program_scores()


def test_network_connection_to_a_host_listener_is_impossible():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    prog = f"""
import socket
try:
    s = socket.create_connection(("127.0.0.1", {port}), timeout=0.5)
    s.sendall(b"exfiltrated")
    print("connected")
except OSError as e:
    print("blocked", type(e).__name__)
"""
    try:
        res = sandboxed(prog, [{"input": "", "output": "connected"}], **OK)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to us
    finally:
        server.close()
    if not REFUSED:
        assert res.status == "failed" and "blocked" in res.detail
    assert_normal_program_scores()


def test_environment_secrets_are_not_inherited(monkeypatch):
    monkeypatch.setenv("GROUPRL_TEST_SECRET", "hunter2")
    prog = """
import os
seen = str(dict(os.environ))
for path in ("/proc/self/environ", "/proc/1/environ"):
    try:
        seen += open(path, "rb").read().decode(errors="replace")
    except OSError:
        pass
print("leaked" if "hunter2" in seen else "clean")
"""
    res = sandboxed(prog, [{"input": "", "output": "leaked"}], **OK)
    if not REFUSED:
        assert res.status == "failed" and "got 'clean'" in res.detail
    assert_normal_program_scores()


def test_fork_bomb_is_bounded_and_leaves_no_process(used_uids):
    prog = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = sandboxed(prog, [{"input": "", "output": ""}], **FAST)
    if not REFUSED:
        assert res.status == "timeout" and res.passed == 0
    assert live_processes(used_uids) == []
    assert_normal_program_scores()


def test_a_run_holds_at_most_its_process_budget():
    res = sandboxed(COUNT_CHILDREN, [{"input": "", "output": "-1"}], **OK)
    if not REFUSED:
        children = int(res.detail.split("got '")[1].rstrip("'"))
        assert 0 < children < sandbox.NPROC, res.detail


def test_a_fork_bomb_does_not_starve_a_concurrent_run():
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
    results = {}
    thread = threading.Thread(target=lambda: results.update(bomb=sandboxed(
        bomb, [{"input": "", "output": ""}], timeout_s=4.0, memory_mb=128)))
    thread.start()
    try:
        time.sleep(1.5)  # the bomb has held its whole process budget for a while by now
        normal = sandboxed("import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\n" + DOUBLE, DOUBLE_TESTS,
                           timeout_s=5.0, memory_mb=128)  # a loaded CI machine must not make this flaky
    finally:
        thread.join()
    if not REFUSED:
        assert normal.status == "passed", normal.detail
        assert results["bomb"].status == "timeout"


def test_memory_bomb():
    res = sandboxed("a = []\nwhile True:\n    a.append(bytearray(10**7))\n", [{"input": "", "output": ""}], **LIMIT)
    if not REFUSED:
        assert res.status == "memory_limit"
    assert_normal_program_scores()


def test_infinite_loop_times_out_and_skips_the_remaining_tests():
    res = sandboxed("while True:\n    pass\n", [{"input": "", "output": ""}] * 3, **FAST)
    if not REFUSED:
        assert (res.status, res.test_status) == ("timeout", ["timeout", "not_run", "not_run"])
        assert res.duration_s < 3 * FAST["timeout_s"]
    assert_normal_program_scores()


def test_gigabytes_of_output_are_cut_off():
    prog = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    res = sandboxed(prog, [{"input": "", "output": "x"}], max_output_bytes=1 << 16, **LIMIT)
    if not REFUSED:
        assert res.status == "output_limit"
    assert_normal_program_scores()


def test_a_stderr_flood_is_stopped_at_the_cap():
    prog = "import sys\nwhile True:\n    sys.stderr.write('x' * 65536)\n"
    res = sandboxed(prog, [{"input": "", "output": ""}], max_output_bytes=1 << 16, **LIMIT)
    if not REFUSED:
        assert res.status == "output_limit"


def test_signalling_the_parent_and_our_process():
    prog = f"""
import os, signal
for pid in (os.getppid(), {os.getpid()}, 1):
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError as e:
        print(pid, type(e).__name__)
print("survived")
"""
    res = sandboxed(prog, [{"input": "", "output": "killed everyone"}], **OK)
    if not REFUSED:
        assert res.status in ("failed", "error") and res.passed == 0
    assert_normal_program_scores()  # we are alive and scoring


def test_daemon_child_does_not_outlive_the_run(used_uids):
    prog = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print("parent done")
"""
    res = sandboxed(prog, [{"input": "", "output": "the daemon is gone"}], **OK)
    if not REFUSED:
        assert res.status == "failed"
    assert live_processes(used_uids) == []
    assert_normal_program_scores()


def test_a_program_that_clears_its_death_signal_and_leaves_the_group_ends_at_the_deadline(used_uids):
    """As userns (no per-run uid to sweep) only the sandbox's own init, PID 1, holds this wall."""
    before = set(live_children())
    res = sandboxed(ESCAPE, [{"input": "", "output": ""}], **FAST)
    if not REFUSED:
        assert res.status == "timeout"
    assert outlivers(before) == []
    assert live_processes(used_uids) == []


def own_children() -> dict[int, str]:
    """This process's children and their states, read from /proc; none is reaped here (live_children reaps)."""
    me, found = str(os.getpid()), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if parent == me:
            found[int(pid)] = state
    return found


def test_a_run_killed_at_its_deadline_leaves_no_zombie_to_a_subreaper():
    """This process is a subreaper (conftest), as a trainer that is a container's PID 1 is: when the launcher
    is killed at the deadline, the sandbox's init is handed to us (it may still be dying when the run
    returns) and must be reaped once dead, not left a zombie."""
    before = set(own_children())
    spin = ["while True:\n    pass\n"] * 4  # four runs: in some the init dies before the launcher, no zombie
    if REFUSED:
        with pytest.raises(SandboxUnavailableError):
            run_code_batch(spin, [[{"input": "", "output": ""}]] * 4, max_workers=4, **FAST)
        return
    results = run_code_batch(spin, [[{"input": "", "output": ""}]] * 4, max_workers=4, **FAST)
    assert [r.status for r in results] == ["timeout"] * 4
    deadline = time.monotonic() + 60.0  # a no-hang bound: with the reaper the children go within moments
    while (left := {p: s for p, s in own_children().items() if p not in before}) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert left == {}


def test_nested_user_namespace_is_refused():
    prog = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000))\n"
    res = sandboxed(prog, [{"input": "", "output": "-1"}], **OK)
    if not REFUSED:
        assert res.status == "passed", res.detail
    assert_normal_program_scores()


def test_filling_the_disk_stops_at_the_limit():
    prog = """
i = 0
while True:
    with open(f"f{i}", "wb") as f:
        f.write(b"x" * (1 << 20))
    i += 1
"""
    res = sandboxed(prog, [{"input": "", "output": ""}], disk_mb=8, **OK)
    if not REFUSED:
        assert res.status in ("error", "timeout") and res.passed == 0
        assert "No space left" in res.detail or "File too large" in res.detail, res.detail
    assert_normal_program_scores()


def test_empty_files_stop_at_the_file_limit():
    """disk_mb bounds a tmpfs's data, not its files: each empty file is kernel memory (a review's
    program grew the host's slab by ~1 GiB in 6 s). Creating files fails at launch.MAX_FILES, as on a
    full disk; the program stops itself at 20,000 where the limit is missing."""
    prog = """
n, errno = 0, None
try:
    while n < 20_000:
        open(f"f{n}", "w").close()
        n += 1
except OSError as e:
    errno = e.errno
print(errno == 28 and n < 5_000)
"""
    res = sandboxed(prog, [{"input": "", "output": "True"}], disk_mb=8, **OK)
    if not REFUSED:
        assert res.status == "passed", res.detail
    assert_normal_program_scores()


def test_a_killed_caller_takes_its_sandbox_with_it(tmp_path):
    """A trainer killed (OOM, a preemption's SIGKILL) while a program sleeps: the program's deadline is
    the caller's, so before the launcher died with its caller its init and the program lived on,
    reparented to PID 1. The run folder it leaves is removed by the next process's first run."""
    import signal
    import subprocess
    import sys

    import grouprl.sandbox

    src = os.path.dirname(os.path.dirname(os.path.dirname(grouprl.sandbox.__file__)))
    caller = subprocess.Popen(
        [sys.executable, "-c", "from grouprl.sandbox import run_code\n"
         "run_code('import time\\ntime.sleep(300)', [{'input': '', 'output': ''}], timeout_s=120, memory_mb=128)"],
        env={**os.environ, "PYTHONPATH": src, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    marker = f"grouprl-sbx-{sandbox._where()}-{caller.pid}-".encode()

    def ours() -> list[int]:  # the launcher and the init: the run folder is in their command line
        pids = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    pids += [int(p)] if marker in f.read() else []
            except OSError:
                pass
        return pids

    try:
        deadline = time.monotonic() + 30
        while not ours() and caller.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if REFUSED:
            assert caller.wait(30) == 1 and b"SandboxUnavailableError" in caller.stderr.read()
            return
        assert ours(), caller.stderr.read() if caller.poll() is not None else "no launcher after 30 s"
        time.sleep(0.5)  # the program started
        caller.send_signal(signal.SIGKILL)
        caller.wait(10)
        deadline = time.monotonic() + 10
        while ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours() == []
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        for pid in ours():
            os.kill(pid, signal.SIGKILL)
    (left,) = tmp_path.iterdir()  # the killed caller never cleaned up
    assert left.name.startswith(f"grouprl-sbx-{sandbox._where()}-{caller.pid}-")
    sweeper = subprocess.run([sys.executable, "-c", "from grouprl.sandbox import run_code\n"
                              "print(run_code('print(1)', [{'input': '', 'output': '1'}]).status)"],
                             env={**os.environ, "PYTHONPATH": src, "TMPDIR": str(tmp_path)}, capture_output=True,
                             text=True, timeout=60)
    assert sweeper.stdout.strip() == "passed", sweeper.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_run_folder_whose_folders_the_program_locked_is_removed(tmp_path):
    """In the weak mode the program writes into the run folder itself, and may take the write and search
    permission from folders it made; the cleanup opens them up first (as its owner: root needs not)."""
    run = tmp_path / "grouprl-sbx-1-x"
    (run / "work" / "d" / "e").mkdir(parents=True)
    (run / "work" / "d" / "e" / "f").write_text("x")
    for path in (run / "work" / "d" / "e", run / "work" / "d"):
        path.chmod(0o500)
    outside = tmp_path / "outside"
    (outside / "kept").mkdir(parents=True)
    (run / "work" / "lnk").symlink_to(outside)  # a link to a folder: removed, not followed (it raised before)
    assert sandbox._remove(str(run)) and not run.exists()
    assert (outside / "kept").is_dir()


def test_the_sweep_removes_only_leftovers_of_gone_processes_of_this_host_and_pid_namespace(tmp_path, monkeypatch):
    """A folder's pid means a process only on its host and in its PID namespace (a container sharing /tmp, a
    TMPDIR on storage several nodes share): those made elsewhere are left alone, like those of live processes."""
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sandbox, "_SWEPT", [])
    gone = next(p for p in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{p}"))
    here = sandbox._where()
    names = {"ours, gone": f"grouprl-sbx-{here}-{gone}-a", "ours, alive": f"grouprl-sbx-{here}-{os.getpid()}-b",
             "elsewhere": f"grouprl-sbx-{'0' * 8 if here != '0' * 8 else '1' * 8}-{gone}-c"}
    for name in names.values():
        (tmp_path / name).mkdir()
    sandbox._sweep_once()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["ours, alive"], names["elsewhere"]])


def test_parallel_runs_leak_no_processes_or_directories(monkeypatch, tmp_path, used_uids):
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(2 * int(input()))\n"
    programs = [DOUBLE, daemon, "while True: pass", DOUBLE] * 2
    if REFUSED:
        with pytest.raises(sandbox.SandboxUnavailableError):
            run_code_batch(programs, [DOUBLE_TESTS] * len(programs), **FAST)
    else:
        results = run_code_batch(programs, [DOUBLE_TESTS] * len(programs), timeout_s=5.0, memory_mb=128)
        assert [r.status for r in results] == ["passed", "passed", "timeout", "passed"] * 2
    assert live_processes(used_uids) == []
    assert list(tmp_path.iterdir()) == []
