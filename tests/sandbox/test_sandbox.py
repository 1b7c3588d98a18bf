"""The code sandbox: correct scoring, and containment of hostile programs.

Each hostile program attacks the host; the test checks the host afterwards (files, processes, our own
listener, our environment), that the call returned a failing CodeResult, and that a normal program
scored right after is scored correctly.
"""

import contextlib
import os
import socket
import tempfile

import pytest

from grouprl.sandbox import runner as sandbox
from grouprl.sandbox import CodeResult, run_code, run_code_batch

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox needs a POSIX host")

FAST = dict(timeout_s=1.5, memory_mb=128)
DOUBLE = "print(2 * int(input()))"
DOUBLE_TESTS = [{"input": "3", "output": "6"}, {"input": "21\n", "output": "42\n"}]


@pytest.fixture
def used_uids(monkeypatch):
    """The sandbox uids claimed during the test (other test processes may run sandboxes concurrently)."""
    uids = []
    claim = sandbox._claim_uid

    @contextlib.contextmanager
    def recording_claim():
        with claim() as uid:
            uids.append(uid)
            yield uid

    monkeypatch.setattr(sandbox, "_claim_uid", recording_claim)
    return uids


def live_processes(uids) -> list[int]:
    """Pids of live processes running under any of `uids`."""
    wanted = set(uids) - {0}
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and sandbox._live_uid(p) in wanted]


def assert_normal_program_scores():
    res = run_code(DOUBLE, DOUBLE_TESTS + [{"input": "5", "output": "11"}], **FAST)
    assert (res.passed, res.total, res.status, res.test_status) == (2, 3, "failed", ["passed", "passed", "failed"])


# ---------------------------------------------------------------- scoring


def test_stdin_stdout_tests_count_and_compare_after_stripping_trailing_whitespace():
    res = run_code("n = int(input())\nprint(n * 2, '  ')\nprint()\n", DOUBLE_TESTS, **FAST)
    assert isinstance(res, CodeResult)
    assert (res.passed, res.total, res.status) == (2, 2, "passed")
    assert res.fraction == 1.0


def test_wrong_answer_is_failed_with_a_readable_detail():
    res = run_code("print(7)", [{"input": "", "output": "6"}], **FAST)
    assert (res.passed, res.status) == (0, "failed")
    assert "expected '6', got '7'" in res.detail


def test_assert_tests_run_in_the_program_namespace():
    prog = "def add(a, b):\n    return a + b\n"
    tests = [{"assert": "assert add(1, 2) == 3"}, {"assert": "assert add(2, 2) == 5"}, {"assert": "assert add(0, 0) == 0"}]
    res = run_code(prog, tests, **FAST)
    assert (res.passed, res.total, res.test_status) == (2, 3, ["passed", "failed", "passed"])


@pytest.mark.parametrize("leave", ["import os\nos._exit(0)", "import sys\nsys.exit(0)", "exit()"])
def test_leaving_early_does_not_pass_an_assert_test(leave):
    res = run_code(leave, [{"assert": "assert False"}], **FAST)
    assert res.passed == 0 and res.status in ("failed", "error")


def test_runtime_error_and_syntax_error():
    res = run_code("raise KeyError('boom')", DOUBLE_TESTS, **FAST)
    assert (res.passed, res.status) == (0, "error") and "KeyError" in res.detail
    res = run_code("def f(:\n", DOUBLE_TESTS, **FAST)
    assert (res.status, res.test_status) == ("syntax_error", ["syntax_error", "not_run"])


def test_no_tests_and_malformed_tests():
    assert run_code("print(1)", []).status == "no_tests"
    with pytest.raises(ValueError, match="test 0"):
        run_code("print(1)", [{"stdin": "1"}])


def test_batch_runs_in_parallel_and_keeps_order():
    programs = [f"print({k} * int(input()))" for k in range(6)]
    tests = [[{"input": "7", "output": str(7 * k)}] for k in range(6)]
    results = run_code_batch(programs, tests, **FAST)
    assert [r.passed for r in results] == [1] * 6
    with pytest.raises(ValueError, match="one test list per program"):
        run_code_batch(programs, tests[:2])


# ---------------------------------------------------------------- hostile programs


def test_read_passwd_and_files_above_the_sandbox(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o644)
    paths = ["/etc/passwd", str(secret), "/root/.bashrc", "../../etc/passwd", "/proc/1/cmdline"]
    prog = f"""
import os
seen = []
for path in {paths!r}:
    try:
        with open(path) as f:
            seen.append("read" if f.read() else "empty")
    except OSError as e:
        seen.append(type(e).__name__)
try:
    seen.append("listed:" + str(len(os.listdir("../.."))))
except OSError as e:
    seen.append(type(e).__name__)
print(" ".join(seen))
"""
    res = run_code(prog, [{"input": "", "output": "read read read read read"}], **FAST)
    assert res.status == "failed" and res.passed == 0
    got = res.detail.split("got ")[1]
    # /etc/passwd reads empty (hidden), the others are unreachable or not ours; /proc/1 is the program itself
    assert got.startswith("'empty FileNotFoundError PermissionError") and "read" not in got.split()[3], got
    assert_normal_program_scores()


def test_write_outside_the_sandbox_directory(tmp_path):
    tag = os.urandom(4).hex()
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)  # even a world-writable host directory must stay untouched
    targets = [f"/tmp/grouprl-pwned-{tag}", f"/var/tmp/grouprl-pwned-{tag}", f"/dev/shm/grouprl-pwned-{tag}",
               f"/etc/grouprl-pwned-{tag}", str(open_dir / "pwned"), f"../pwned-{tag}"]
    prog = f"""
ok = 0
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        ok += 1
    except OSError:
        pass
print("wrote", ok)
"""
    res = run_code(prog, [{"input": "", "output": f"wrote {len(targets)}"}], **FAST)
    assert res.status == "failed"
    for path in targets[:-1]:
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
        res = run_code(prog, [{"input": "", "output": "connected"}], **FAST)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to us
    finally:
        server.close()
    assert res.status == "failed" and "blocked" in res.detail
    assert_normal_program_scores()


def test_fork_bomb_is_bounded_and_leaves_no_process(used_uids):
    prog = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = run_code(prog, [{"input": "", "output": ""}], **FAST)
    assert res.status == "timeout" and res.passed == 0
    assert used_uids and live_processes(used_uids) == []
    assert_normal_program_scores()


def test_memory_bomb():
    res = run_code("a = []\nwhile True:\n    a.append(bytearray(10**7))\n", [{"input": "", "output": ""}], **FAST)
    assert res.status == "memory_limit"
    assert_normal_program_scores()


def test_infinite_loop_times_out_and_skips_the_remaining_tests():
    res = run_code("while True:\n    pass\n", [{"input": "", "output": ""}] * 3, **FAST)
    assert (res.status, res.test_status) == ("timeout", ["timeout", "not_run", "not_run"])
    assert res.duration_s < 3 * FAST["timeout_s"]
    assert_normal_program_scores()


def test_gigabytes_of_output_are_cut_off():
    prog = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    res = run_code(prog, [{"input": "", "output": "x"}], max_output_bytes=1 << 16, **FAST)
    assert res.status == "output_limit"
    assert_normal_program_scores()


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
    res = run_code(prog, [{"input": "", "output": "killed everyone"}], **FAST)
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
    res = run_code(prog, [{"input": "", "output": "the daemon is gone"}], **FAST)
    assert res.status == "failed"
    assert used_uids and live_processes(used_uids) == []
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
    res = run_code(prog, [{"input": "", "output": "leaked"}], **FAST)
    assert res.status == "failed" and "got 'clean'" in res.detail
    assert_normal_program_scores()


def test_filling_the_disk_stops_at_the_limit():
    prog = """
i = 0
while True:
    with open(f"f{i}", "wb") as f:
        f.write(b"x" * (1 << 20))
    i += 1
"""
    res = run_code(prog, [{"input": "", "output": ""}], disk_mb=8, **FAST)
    assert res.status in ("error", "timeout") and res.passed == 0
    assert_normal_program_scores()


def test_parallel_runs_leak_no_processes_or_directories(monkeypatch, tmp_path, used_uids):
    if sandbox.sandbox_mechanism()[0] != "namespace":
        pytest.skip("the run directory must be traversable by the sandbox uid in rlimit mode")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(2 * int(input()))\n"
    programs = [DOUBLE, daemon, "while True: pass", DOUBLE] * 2
    results = run_code_batch(programs, [DOUBLE_TESTS] * len(programs), **FAST)
    assert [r.status for r in results] == ["passed", "passed", "timeout", "passed"] * 2
    assert used_uids and live_processes(used_uids) == []
    assert list(tmp_path.iterdir()) == []


def test_rlimit_fallback_blocks_sockets_and_still_scores(monkeypatch):
    monkeypatch.setenv("GROUPRL_SANDBOX_MODE", "rlimit")
    monkeypatch.setattr(sandbox, "_mechanism", None)
    try:
        assert sandbox.sandbox_mechanism()[0] == "rlimit"
        prog = "import socket\ntry:\n    socket.socket()\n    print('open')\nexcept PermissionError:\n    print('blocked')\n"
        res = run_code(prog, [{"input": "", "output": "blocked"}], **FAST)
        assert res.status == "passed"
        assert run_code("while True: pass", [{"input": "", "output": ""}], **FAST).status == "timeout"
        assert_normal_program_scores()
    finally:
        monkeypatch.setattr(sandbox, "_mechanism", None)
