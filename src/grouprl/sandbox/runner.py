"""Run untrusted Python programs against tests, isolated: `run_code`, `run_code_batch`, `CodeResult`.

Every test is one fresh sandboxed process (see `launch.py` for the isolation steps and
`harness.py` for how a test is judged). This module owns what happens around it:

- a dedicated uid per concurrent run (when we are root), claimed with a file lock from a pool, so
  RLIMIT_NPROC (which counts per uid) bounds one run's processes and never another's, and so every
  process left behind can be found by uid and killed;
- a wall-clock deadline per test, stdout/stderr read with a byte cap, the whole process group and every
  process of the run's uid killed when the test ends, the temporary directory removed;
- choosing the mechanism once per process: "namespace" (network + mount + PID namespaces, tmpfs, uid
  drop) when the kernel allows it, else "rlimit" (uid drop when root, rlimits, audit-hook socket block).
  `GROUPRL_SANDBOX_MODE=rlimit` forces the fallback; `GROUPRL_SANDBOX_PYTHON` picks the interpreter.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER = os.path.join(_HERE, "launch.py")
_HARNESS = os.path.join(_HERE, "harness.py")

SLOT_BASE_UID = 1_900_000_000  # far above any real account; uid = gid = base + slot
NUM_SLOTS = 256
NPROC = 32  # processes + threads a run may hold
NOFILE = 64
_EXIT_SYNTAX, _EXIT_CPU, _EXIT_SETUP = 3, 124, 125
_LOCK_DIR = "/tmp/grouprl-sandbox-slots"  # fixed (not $TMPDIR): every process on the host must agree
_STOP_STATUSES = ("timeout", "syntax_error", "sandbox_error", "output_limit")


@dataclass
class CodeResult:
    """Outcome of one program on its tests.

    status: "passed" (every test), "failed" (a wrong answer or failed assert), "error" (the program
    raised or exited non-zero), "syntax_error", "timeout", "memory_limit", "output_limit",
    "no_tests", "sandbox_error". When not all tests passed it is the status of the first failing test.
    """

    passed: int
    total: int
    status: str
    detail: str = ""
    test_status: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    mechanism: str = ""

    @property
    def fraction(self) -> float | None:
        return self.passed / self.total if self.total else None


# ---------------------------------------------------------------- mechanism choice (once per process)

_mechanism_lock = threading.Lock()
_mechanism: tuple[str, str] | None = None


def sandbox_mechanism() -> tuple[str, str]:
    """(mode, interpreter) in force: mode is "namespace" or "rlimit". Probed on first use, then cached."""
    global _mechanism
    with _mechanism_lock:
        if _mechanism is None:
            _mechanism = _probe()
        return _mechanism


def _probe() -> tuple[str, str]:
    forced = os.environ.get("GROUPRL_SANDBOX_MODE")
    if forced not in (None, "", "namespace", "rlimit"):
        raise ValueError(f"GROUPRL_SANDBOX_MODE={forced!r}: use 'namespace' or 'rlimit'")
    modes = [forced] if forced else (["namespace", "rlimit"] if os.geteuid() == 0 else ["rlimit"])
    pythons = [os.environ.get("GROUPRL_SANDBOX_PYTHON") or ""]
    if not pythons[0]:
        pythons = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
        pythons = [p for i, p in enumerate(pythons) if os.path.exists(p) and p not in pythons[:i]]
    errors = []
    for mode in modes:
        for python in pythons:
            res = _run_tests("print(6 * 7)", [{"input": "", "output": "42"}], 10.0, 256, 1 << 16, 8, mode, python)
            if res.status == "passed":
                return mode, python
            errors.append(f"{mode} with {python}: {res.status} {res.detail}")
    raise RuntimeError("no working sandbox: " + "; ".join(errors))


# ---------------------------------------------------------------- public API


def run_code(
    program: str,
    tests: list[dict],
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 1 << 20,
    disk_mb: int = 64,
) -> CodeResult:
    """Run `program` (Python source) on each test in a sandbox; count the tests passed.

    A test is {"input": str, "output": str} (stdin -> stdout, compared after stripping trailing
    whitespace of the whole output and of each line) or {"assert": str} (Python run after the program,
    in its namespace). timeout_s is wall time per test (CPU time is limited to ceil(timeout_s));
    after a timeout, a syntax error or an output overflow the remaining tests are not run and count
    as failed. memory_mb bounds the address space, disk_mb the writable tmpfs and any file's size.
    """
    if not tests:
        return CodeResult(0, 0, "no_tests", "no tests given")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not ({"input", "output"} <= t.keys() or "assert" in t):
            raise ValueError(f"test {i} is {t!r}: a test is {{'input': str, 'output': str}} or {{'assert': str}}")
    try:
        mode, python = sandbox_mechanism()
    except RuntimeError as e:
        return CodeResult(0, len(tests), "sandbox_error", str(e)[:300], ["sandbox_error"] * len(tests))
    return _run_tests(program, tests, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python)


def run_code_batch(
    programs: list[str], tests: list[list[dict]], *, max_workers: int | None = None, **kwargs
) -> list[CodeResult]:
    """`run_code` over many programs concurrently, one thread per core by default; order preserved."""
    if len(programs) != len(tests):
        raise ValueError(f"{len(programs)} programs but {len(tests)} test lists: give one test list per program")
    workers = max_workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda pt: run_code(pt[0], pt[1], **kwargs), zip(programs, tests)))


# ---------------------------------------------------------------- one program, all its tests


def _run_tests(program, tests, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python) -> CodeResult:
    start = time.monotonic()
    statuses: list[str] = []
    detail = ""
    with _claim_uid() as uid:
        run_dir = tempfile.mkdtemp(prefix="grouprl-sbx-")
        try:
            _write(os.path.join(run_dir, "program.py"), program)
            shutil.copyfile(_HARNESS, os.path.join(run_dir, "harness.py"))
            if mode == "rlimit":
                work = os.path.join(run_dir, "work")
                os.mkdir(work, 0o700)
                if uid:
                    os.chmod(run_dir, 0o711)  # the sandbox uid may traverse, not list
                    os.chown(work, uid, uid)
            for i, test in enumerate(tests):
                status, why = _run_one(program, test, run_dir, uid, timeout_s, memory_mb,
                                       max_output_bytes, disk_mb, mode, python)
                statuses.append(status)
                if status != "passed" and not detail:
                    detail = f"test {i}: {why}"
                if status in _STOP_STATUSES:
                    statuses += ["not_run"] * (len(tests) - len(statuses))
                    break
        finally:
            if uid:
                _kill_uid(uid)
            shutil.rmtree(run_dir, ignore_errors=True)
    passed = statuses.count("passed")
    first_bad = next((s for s in statuses if s != "passed"), "passed")
    return CodeResult(passed, len(tests), first_bad, detail, statuses, time.monotonic() - start,
                      f"{mode} ({python})")


def _write(path, text, mode=0o444):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, mode)


def _run_one(program, test, run_dir, uid, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python):
    """Run one test; return (status, reason)."""
    is_assert = "assert" in test
    test_path = os.path.join(run_dir, "test.py")
    if os.path.exists(test_path):
        os.unlink(test_path)
    if is_assert:
        _write(test_path, str(test["assert"]))
    stdin_path = os.path.join(run_dir, "stdin.txt")
    _write(stdin_path, "" if is_assert else str(test["input"]), mode=0o400)
    nonce = secrets.token_hex(16).encode()
    cfg = {
        "mode": mode, "python": python, "run_dir": run_dir, "has_test": is_assert,
        "uid": uid, "gid": uid, "cpu_s": max(1, math.ceil(timeout_s)), "as_bytes": memory_mb << 20,
        "fsize_bytes": disk_mb << 20, "disk_mb": disk_mb, "nproc": NPROC, "nofile": NOFILE,
    }
    r, w = os.pipe()
    os.write(w, nonce)
    os.close(w)
    cfg["nonce_fd"] = r
    try:
        with open(stdin_path, "rb") as stdin:
            out, err, rc, stopped = _execute(
                [python, "-I", "-S", "-B", _LAUNCHER, json.dumps(cfg)], stdin, r, uid, timeout_s, max_output_bytes
            )
    finally:
        os.close(r)
    marker = b"\n" + nonce + b"\n"
    finished = out.endswith(marker)
    if finished:
        out = out[: -len(marker)]
    err_text = err.decode("utf-8", "replace")
    if stopped == "timeout":
        return stopped, f"timeout ({timeout_s:g} s wall)"
    if stopped == "output_limit":
        return stopped, f"output exceeded {max_output_bytes} bytes"
    if rc == _EXIT_SETUP and "sandbox setup failed" in err_text:
        return "sandbox_error", _last_line(err_text)
    if rc == _EXIT_SYNTAX:
        return "syntax_error", _last_line(err_text)
    if rc == _EXIT_CPU or rc == 128 + signal.SIGXCPU:
        return "timeout", f"CPU limit ({cfg['cpu_s']} s)"
    if "MemoryError" in err_text:
        return "memory_limit", f"MemoryError (address space limit {memory_mb} MiB)"
    if rc != 0:
        if is_assert and "AssertionError" in err_text:
            return "failed", _last_line(err_text)
        if rc > 128:
            return "error", f"killed by {_signal_name(rc - 128)}"
        return "error", _last_line(err_text) or f"exit code {rc}"
    if is_assert:
        if not finished:
            return "error", "the program exited before the test ran"
        return "passed", ""
    got = _normalise(out.decode("utf-8", "replace"))
    expected = _normalise(str(test["output"]))
    if got == expected:
        return "passed", ""
    return "failed", f"expected {expected[:60]!r}, got {got[:60]!r}"


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# ---------------------------------------------------------------- process handling


def _execute(argv, stdin, pass_fd, uid, timeout_s, cap):
    """Start the launcher, read stdout/stderr (each capped at `cap` bytes) until exit or deadline.

    Returns (stdout, stderr, returncode, stopped) where stopped is "timeout", "output_limit" or "".
    Whatever happens, the process group and every process of `uid` are killed before returning.
    """
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(pass_fd,),
        start_new_session=True, env=env, cwd="/",
    )
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    stopped = ""
    deadline = time.monotonic() + timeout_s
    hard_stop = None  # after a kill or exit, stop waiting for EOF at this time
    sel = selectors.DefaultSelector()
    try:
        for f in (proc.stdout, proc.stderr):
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if hard_stop is not None and now >= hard_stop:
                break
            if hard_stop is None and now >= deadline:
                stopped = "timeout"
                _kill(proc, uid)
                hard_stop = now + 1.0
            elif hard_stop is None and proc.poll() is not None:
                hard_stop = now + 0.5  # exited: drain what is left, then kill anything holding the pipes
            for key, _ in sel.select(timeout=0.05):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fd]
                room = cap - len(buf)
                buf += data[:room]
                if len(data) > room and key.fd == out_fd and not stopped:
                    stopped = "output_limit"
                    _kill(proc, uid)
                    hard_stop = time.monotonic() + 1.0
    finally:
        sel.close()
        _kill(proc, uid)
        proc.stdout.close()
        proc.stderr.close()
        rc = proc.wait()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), rc, stopped


def _kill(proc, uid):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process whose real uid is `uid` until none is left (forks race the scan)."""
    for _ in range(100):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit() and _live_uid(name) == uid:
                found = True
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        if not found:
            return
        time.sleep(0.01)


def _live_uid(pid: str) -> int | None:
    """Real uid of /proc/<pid>, None for zombies (already dead, waiting to be reaped) and vanished pids."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X"):
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


@contextmanager
def _claim_uid():
    """Yield a sandbox uid no other run (thread or process) holds, or 0 when not root (no uid drop)."""
    if os.geteuid() != 0:
        yield 0
        return
    lock_dir = _LOCK_DIR
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    while True:
        for slot in random.sample(range(NUM_SLOTS), NUM_SLOTS):
            fd = os.open(os.path.join(lock_dir, f"slot-{slot}.lock"), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            uid = SLOT_BASE_UID + slot
            try:
                _kill_uid(uid)  # leftovers of a crashed earlier holder
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return
        time.sleep(0.05)
