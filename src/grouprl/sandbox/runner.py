"""Run untrusted Python programs, isolated: against tests (`run_code`, `run_code_batch`, `CodeResult`) or
once for their output (`run_program`, `ProgramResult`).

Every test is one fresh sandboxed process (`launch.py` isolates, `harness.py` judges the test). This
module owns what happens around it:

- choosing the mechanism once per process (`sandbox_mechanism()`, a probe run):
  "namespace" when we are root (new mount, network, PID, IPC and UTS namespaces, a minimal read-only
  root, and a dedicated uid per concurrent run); "userns" when we are not root and the kernel allows
  unprivileged user namespaces (the same walls inside a user namespace owned by the caller); "rlimit",
  weak isolation (rlimits and an audit hook), only when asked for: `GROUPRL_SANDBOX_MODE=rlimit`, or
  `isolation="weak"` when neither isolating mode works. Otherwise `SandboxUnavailableError` says what
  is missing and how to get it: the default is never a silent weak sandbox;
- a dedicated uid per concurrent run when root (in "userns" mode too: kernel uid 0 is exempt from
  RLIMIT_NPROC), claimed with a file lock from a pool, so RLIMIT_NPROC (counted per uid) bounds one
  run's processes and never another's, and every process left behind can be found by uid and killed.
  Without root the user namespace does that job: RLIMIT_NPROC is counted per user namespace
  (Linux >= 5.14) and the PID namespace, whose init is ours, takes every process with it;
- a wall-clock deadline per test, stdin fed through a pipe, stdout/stderr read with a byte cap each,
  the process group killed when the test ends, the temporary directory removed; any failure of this
  machinery is a `CodeResult(status="sandbox_error")`, never a stray OSError, and decided only from
  the launcher's private status pipe, never from what the program prints or how it exits.

`GROUPRL_SANDBOX_MODE` (auto | namespace | userns | rlimit) forces a mode; `GROUPRL_SANDBOX_PYTHON`
picks the interpreter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from . import harness
from .process import claim_uid, execute, kill_uid

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_LAUNCHER = os.path.join(_HERE, "launch.py")
_HARNESS = os.path.join(_HERE, "harness.py")

NPROC = 32  # processes + threads a run may hold
NOFILE = 64
MODES = ("namespace", "userns", "rlimit")
ISOLATION = ("strict", "weak")
_STOP_STATUSES = ("timeout", "syntax_error", "sandbox_error", "output_limit")
_FIX = (
    "To isolate without root, allow unprivileged user namespaces: in Docker or Podman run the container "
    "with `--security-opt seccomp=unconfined` (the default seccomp profile blocks them); on Debian or older "
    "Ubuntu `sysctl -w kernel.unprivileged_userns_clone=1`; on Ubuntu 23.10+ "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`; where /proc/sys/user/max_user_namespaces "
    "is 0, `sysctl -w user.max_user_namespaces=10000`. Or run as root with CAP_SYS_ADMIN. To run untrusted "
    "code with weak isolation instead (rlimits and an audit hook, not a security boundary), opt in with "
    "GROUPRL_SANDBOX_MODE=rlimit or isolation='weak' (code_tests(..., isolation='weak'))."
)


class SandboxUnavailableError(RuntimeError):
    """No isolating mechanism works on this host, and weak isolation was not asked for."""


class SandboxMechanism(NamedTuple):
    """What `run_code` uses: mode ("namespace", "userns" or "rlimit") and the interpreter."""

    mode: str
    python: str

    @property
    def weak(self) -> bool:
        return self.mode == "rlimit"

    def describe(self) -> str:
        userns = ("namespaces inside a user namespace, a per-run uid (root)" if os.geteuid() == 0
                  else "namespaces inside an unprivileged user namespace")
        what = {"namespace": "namespaces and a per-run uid (root)", "userns": userns,
                "rlimit": "WEAK: rlimits and an audit hook only, no isolation from the host"}[self.mode]
        return f"{self.mode} ({what}), interpreter {self.python}"


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
_probed: dict[str, SandboxMechanism | SandboxUnavailableError] = {}  # "strict:<forced mode>" / "rlimit"
_warned_weak = False


def sandbox_mechanism(isolation: str = "strict") -> SandboxMechanism:
    """The mechanism `run_code(..., isolation=isolation)` uses. Probed on first use, then cached.

    Raises SandboxUnavailableError (what failed, and how to fix it) when no isolating mode works and
    weak isolation was not asked for; ValueError for a bad GROUPRL_SANDBOX_MODE or isolation.
    """
    global _warned_weak
    if isolation not in ISOLATION:
        raise ValueError(f"isolation={isolation!r}: use 'strict' (namespaces, refuse otherwise) or 'weak' "
                         "(fall back to rlimits and an audit hook when namespaces are unavailable)")
    forced = os.environ.get("GROUPRL_SANDBOX_MODE") or "auto"
    if forced not in ("auto",) + MODES:
        raise ValueError(f"GROUPRL_SANDBOX_MODE={forced!r}: use one of auto, {', '.join(MODES)}")
    with _mechanism_lock:
        if forced != "rlimit":
            key = f"strict:{forced}"
            if key not in _probed:
                modes = [forced] if forced != "auto" else ["namespace", "userns"] if os.geteuid() == 0 else ["userns"]
                _probed[key] = _probe(modes)
            found = _probed[key]
            if isinstance(found, SandboxMechanism):
                return found
            if isolation == "strict" or forced != "auto":
                raise found
        if "rlimit" not in _probed:
            _probed["rlimit"] = _probe(["rlimit"])
        found = _probed["rlimit"]
        if isinstance(found, SandboxUnavailableError):
            raise found
        if not _warned_weak:
            _warned_weak = True
            logger.warning("grouprl sandbox: untrusted code runs with %s. %s", found.describe(),
                           "Forced by GROUPRL_SANDBOX_MODE=rlimit." if forced == "rlimit" else _FIX)
        return found


def _probe(modes: list[str]) -> SandboxMechanism | SandboxUnavailableError:
    pythons = [os.environ.get("GROUPRL_SANDBOX_PYTHON") or ""]
    if not pythons[0]:
        pythons = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
        pythons = [p for i, p in enumerate(pythons) if os.path.exists(p) and p not in pythons[:i]]
    errors = []
    for mode in modes:
        for python in pythons:
            res = _run_tests("print(6 * 7)", [{"input": "", "output": "42"}], 10.0, 256, 1 << 16, 8, mode, python)
            if res.status == "passed":
                return SandboxMechanism(mode, python)
            errors.append(f"{mode} with {python}: {res.status}: {res.detail}")
    tried = "; ".join(errors)
    if modes == ["rlimit"]:
        return SandboxUnavailableError(f"the weak sandbox does not run either: {tried}")
    return SandboxUnavailableError(
        f"no isolating sandbox works here (running as uid {os.geteuid()}), so untrusted code is not run. "
        f"Tried: {tried}. {_FIX}")


_memory_ok: set[tuple[SandboxMechanism, int]] = set()


def check_memory(memory_mb: int, isolation: str = "strict") -> None:
    """Raise ValueError, naming memory_mb, when a trivial program does not run with `memory_mb` MiB of
    address space in the sandbox in force (too little for the interpreter itself): the `code_tests` reward
    and the `python` tool call this when built, so a run stops before its first step instead of scoring
    every program 0. Passing sizes are remembered per mechanism. SandboxUnavailableError as
    `sandbox_mechanism`."""
    mech = sandbox_mechanism(isolation)
    if (mech, memory_mb) in _memory_ok:
        return
    res = _run_tests("print(6 * 7)", [{"input": "", "output": "42"}], 10.0, memory_mb, 1 << 16, 8, *mech)
    if res.status != "passed":
        raise ValueError(f"memory_mb={memory_mb}: the sandbox cannot run print(6 * 7) within it; {mech.python} "
                         f"needs more ({res.status}: {res.detail})")
    _memory_ok.add((mech, memory_mb))


# ---------------------------------------------------------------- public API


def run_code(
    program: str,
    tests: list[dict],
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 1 << 20,
    disk_mb: int = 64,
    isolation: str = "strict",
) -> CodeResult:
    """Run `program` (Python source) on each test in a sandbox; count the tests passed.

    A test is {"input": str, "output": str} (stdin -> stdout, compared after stripping trailing
    whitespace of the whole output and of each line) or {"assert": str} (Python run after the program,
    in its namespace). timeout_s is wall time per test (CPU time is limited to ceil(timeout_s));
    after a timeout, a syntax error or an output overflow the remaining tests are not run and count
    as failed. memory_mb bounds the address space, disk_mb the writable tmpfs and any file's size.
    isolation="strict" (default) raises SandboxUnavailableError where no namespace mechanism works;
    "weak" then runs with rlimits and an audit hook only, and logs a warning once.
    """
    if not tests:
        return CodeResult(0, 0, "no_tests", "no tests given")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not ({"input", "output"} <= t.keys() or "assert" in t):
            raise ValueError(f"test {i} is {t!r}: a test is {{'input': str, 'output': str}} or {{'assert': str}}")
    mode, python = sandbox_mechanism(isolation)
    return _run_tests(program, tests, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python)


def run_code_batch(
    programs: list[str], tests: list[list[dict]], *, max_workers: int | None = None, **kwargs
) -> list[CodeResult]:
    """`run_code` over many programs concurrently, one thread per core by default; order preserved."""
    if len(programs) != len(tests):
        raise ValueError(f"{len(programs)} programs but {len(tests)} test lists: give one test list per program")
    sandbox_mechanism(kwargs.get("isolation", "strict"))  # refuse before starting any thread
    workers = max_workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda pt: run_code(pt[0], pt[1], **kwargs), zip(programs, tests)))


@dataclass
class ProgramResult:
    """What one run of a program printed, and how it ended: `run_program`'s answer.

    status: "ok" (exited 0), "error" (raised or exited non-zero; `detail` says how), "syntax_error",
    "timeout", "memory_limit", "output_limit" (stdout passed the cap: the program was stopped and
    `stdout` holds what came before), "sandbox_error" (ours, not the program's; cause in `detail`).
    """

    status: str
    stdout: str
    stderr: str
    detail: str = ""
    duration_s: float = 0.0
    mechanism: str = ""


def run_program(
    program: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 1 << 20,
    disk_mb: int = 64,
    isolation: str = "strict",
) -> ProgramResult:
    """Run `program` (Python source) once in a sandbox, stdin empty; return its stdout and stderr.

    The same sandbox, limits and `isolation` as `run_code` (one fresh process tree; stdout and stderr
    are each read up to max_output_bytes), without tests to judge: the `python` tool's runner.
    """
    mode, python = sandbox_mechanism(isolation)
    start = time.monotonic()
    try:
        with _prepared_run(program, mode) as (run_dir, uid):
            end = _launch({"input": ""}, run_dir, uid, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python)
    except OSError as e:  # our machinery, never the program's fault
        return ProgramResult("sandbox_error", "", "", f"the sandbox failed: {type(e).__name__}: {e}",
                             time.monotonic() - start, f"{mode} ({python})")
    status, detail = _end_status(end, timeout_s, memory_mb, max_output_bytes)
    return ProgramResult(status, end.stdout.decode("utf-8", "replace"), end.stderr, detail,
                         time.monotonic() - start, f"{mode} ({python})")


# ---------------------------------------------------------------- one program, all its tests


def _run_tests(program, tests, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python) -> CodeResult:
    start = time.monotonic()
    statuses: list[str] = []
    detail = ""
    try:
        with _prepared_run(program, mode) as (run_dir, uid):
            for i, test in enumerate(tests):
                status, why = _run_one(test, run_dir, uid, timeout_s, memory_mb, max_output_bytes, disk_mb, mode,
                                       python)
                statuses.append(status)
                if status != "passed" and not detail:
                    detail = f"test {i}: {why}"
                if status in _STOP_STATUSES:
                    statuses += ["not_run"] * (len(tests) - len(statuses))
                    break
    except OSError as e:  # our machinery (a full /tmp, no processes left to start one): never the program's fault
        i = min(len(statuses), len(tests) - 1)
        statuses = statuses[:i] + ["sandbox_error"] + ["not_run"] * (len(tests) - i - 1)
        detail = f"test {i}: the sandbox failed: {type(e).__name__}: {e}"
    passed = statuses.count("passed")
    first_bad = next((s for s in statuses if s != "passed"), "passed")
    return CodeResult(passed, len(tests), first_bad, detail, statuses, time.monotonic() - start,
                      f"{mode} ({python})")


@contextmanager
def _prepared_run(program, mode):
    """Yield (run_dir, uid): a claimed uid (when root; else 0) and a fresh directory holding the program
    and the harness. Afterwards every process of the uid is killed and the directory removed."""
    _sweep_once()
    with claim_uid() as uid:
        run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{_where()}-{os.getpid()}-")
        try:
            _write(os.path.join(run_dir, "program.py"), program)
            shutil.copyfile(_HARNESS, os.path.join(run_dir, "harness.py"))
            if mode == "rlimit":
                work = os.path.join(run_dir, "work")
                os.mkdir(work, 0o700)
                if uid:
                    os.chmod(run_dir, 0o711)  # the sandbox uid may traverse, not list
                    os.chown(work, uid, uid)
            yield run_dir, uid
        finally:
            if uid:
                kill_uid(uid)
            _remove(run_dir)


RUN_DIR_PREFIX = "grouprl-sbx-"  # then _where() and the pid of the process whose runs the folder holds
_SWEPT: list[bool] = []


def _remove(path: str) -> bool:
    """Remove a run folder, also where the program took its write or search permission from folders it
    made (rmtree alone cannot empty them, and left the folder). True when it is gone."""
    for root, dirs, _ in os.walk(path):  # top-down: each folder is opened up before it is entered
        for d in dirs:
            if not os.path.islink(os.path.join(root, d)):  # a link the program made: not followed, removed as is
                try:
                    os.chmod(os.path.join(root, d), 0o700)
                except OSError:
                    pass
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        logger.warning("sandbox: could not remove %s; delete it by hand", path)
        return False
    return True


def _sweep_once() -> None:
    """Once per process: remove run folders of our uid left in the temp folder by a process that is gone
    (killed before its cleanup ran)."""
    if _SWEPT:
        return
    _SWEPT.append(True)
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    ours = f"{RUN_DIR_PREFIX}{_where()}-"
    for name in names:
        pid = name[len(ours):].split("-", 1)[0]
        if not name.startswith(ours) or not pid.isdigit():  # another host's or PID namespace's, or not a run's
            continue
        path = os.path.join(tmp, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # alive (or another process has its pid now): left alone
        except ProcessLookupError:
            try:
                _remove(path)
            except Exception as e:  # noqa: BLE001 -- a leftover never fails a run
                logger.warning("sandbox: could not remove %s (%s); delete it by hand", path, e)
        except OSError:
            continue


def _where() -> str:
    """This host and PID namespace, as 8 hex digits: a pid names a process only there (a container with the
    host's /tmp, a TMPDIR on storage that several nodes share), so the sweep reads only folders made here."""
    import hashlib
    import socket

    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return hashlib.sha256(f"{socket.gethostname()} {ns}".encode()).hexdigest()[:8]


def _write(path, text, mode=0o444):
    """Write a fresh file (unlinked first: an earlier test's copy is read-only to us when we are not root).
    A lone surrogate (from JSON, say) cannot be UTF-8: it becomes "?" rather than an exception."""
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
        f.write(text)


class _Exit(NamedTuple):
    """How one sandboxed process ended: its stdout (without the harness's verdict), stderr, exit code, why we
    stopped it ("timeout", "output_limit" or ""), the harness's verdict (harness.py; b"" when none came),
    and what the launcher said on the status pipe: b"S" once the harness ran, else its setup failure."""

    stdout: bytes
    stderr: str
    rc: int
    stopped: str
    verdict: bytes
    report: bytes

    @property
    def finished(self) -> bool:
        """The program and its test ran to the end (the harness said so, with the run's nonce)."""
        return self.verdict == harness.FINISHED


def _launch(test, run_dir, uid, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python) -> _Exit:
    """Run the prepared program once in a fresh sandbox, with `test`'s stdin or after it its assert."""
    is_assert = "assert" in test
    test_path = os.path.join(run_dir, "test.py")
    if os.path.exists(test_path):
        os.unlink(test_path)
    if is_assert:
        _write(test_path, str(test["assert"]))
    stdin = b"" if is_assert else str(test["input"]).encode("utf-8", "replace")
    nonce = secrets.token_hex(16).encode()
    cfg = {
        "mode": mode, "python": python, "run_dir": run_dir, "has_test": is_assert,
        "uid": uid, "gid": uid, "cpu_s": _cpu_s(timeout_s), "as_bytes": memory_mb << 20,
        "fsize_bytes": disk_mb << 20, "disk_mb": disk_mb, "nproc": NPROC, "nofile": NOFILE,
        "caller_pid": os.getpid(),
    }
    nonce_r, nonce_w = os.pipe()
    os.write(nonce_w, nonce)
    os.close(nonce_w)
    status_r, status_w = os.pipe()  # the launcher's and harness's word, which the program never holds
    cfg.update(nonce_fd=nonce_r, status_fd=status_w)
    verdict_len = len(nonce) + 3  # b"\n" + nonce + verdict + b"\n", not counted against the cap
    try:
        out, err, rc, stopped = execute(
            [python, "-I", "-S", "-B", _LAUNCHER, json.dumps(cfg)], stdin, (nonce_r, status_w), uid, timeout_s,
            (max_output_bytes + verdict_len, max_output_bytes),
        )
        os.set_blocking(status_r, False)
        try:
            report = os.read(status_r, 8192)  # all writers are dead by now
        except BlockingIOError:
            report = b""
    finally:
        for fd in (nonce_r, status_r, status_w):
            os.close(fd)
    verdict = b""
    tail = out[-verdict_len:]
    if len(tail) == verdict_len and tail.startswith(b"\n" + nonce) and tail.endswith(b"\n"):
        out, verdict = out[:-verdict_len], tail[-2:-1]
    if len(out) > max_output_bytes:  # the program's own bytes in the marker's allowance
        out, stopped = out[:max_output_bytes], stopped or "output_limit"
    return _Exit(out, err.decode("utf-8", "replace"), rc, stopped, verdict, report)


def _cpu_s(timeout_s: float) -> int:
    return max(1, math.ceil(timeout_s))


def _end_status(end: _Exit, timeout_s, memory_mb, max_output_bytes) -> tuple[str, str]:
    """(status, reason) for how the process ended, whatever it was asked: ("ok", "") when it exited 0.

    sandbox_error comes only from the status pipe, and syntax_error, memory_limit and the CPU limit only
    from the harness's verdict or the kernel: no exit code or text a program prints can produce them."""
    if end.report and not end.report.startswith(b"S"):
        return "sandbox_error", end.report.decode("utf-8", "replace")
    if end.stopped == "timeout":  # the wall time counts from the launch, start-up included (a loaded machine)
        return "timeout", f"timeout ({timeout_s:g} s wall)"
    if not end.report:
        why = _last_line(end.stderr) or f"exit code {end.rc}"
        return "sandbox_error", (f"the sandbox's interpreter did not start ({why}); "
                                 f"is memory_mb={memory_mb} enough for it?")
    if end.stopped == "output_limit":
        return "output_limit", f"output exceeded {max_output_bytes} bytes"
    if end.verdict == harness.SYNTAX:
        return "syntax_error", _last_line(end.stderr)
    if end.verdict == harness.CPU or end.rc == 128 + signal.SIGXCPU:
        return "timeout", f"CPU limit ({_cpu_s(timeout_s)} s)"
    if end.verdict == harness.MEMORY:
        return "memory_limit", f"MemoryError (address space limit {memory_mb} MiB)"
    if end.rc > 128:
        return "error", f"killed by {_signal_name(end.rc - 128)}"
    if end.rc != 0 or end.verdict == harness.ERROR:
        return "error", _last_line(end.stderr) or f"exit code {end.rc}"
    return "ok", ""


def _run_one(test, run_dir, uid, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python):
    """Run one test; return (status, reason)."""
    end = _launch(test, run_dir, uid, timeout_s, memory_mb, max_output_bytes, disk_mb, mode, python)
    status, why = _end_status(end, timeout_s, memory_mb, max_output_bytes)
    is_assert = "assert" in test
    if status == "error" and is_assert and "AssertionError" in end.stderr:
        return "failed", _last_line(end.stderr)
    if status != "ok":
        return status, why
    if is_assert:
        if not end.finished:
            return "error", "the program exited before the test ran"
        return "passed", ""
    got = _normalise(end.stdout.decode("utf-8", "replace"))
    expected = _normalise(str(test["output"]))
    if got == expected:
        return "passed", ""
    return "failed", f"expected {expected[:60]!r}, got {got[:60]!r}"


def _normalise(text: str) -> str:
    """Lines split at LF (or CRLF) only, each without trailing spaces, tabs and CRs, and no trailing empty
    lines: a form feed, U+2028 or a no-break space is the program's output, not layout."""
    lines = [line.rstrip(" \t\r") for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
