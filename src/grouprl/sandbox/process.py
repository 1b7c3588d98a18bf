"""Process handling for the sandbox: start the launcher, read its output with a cap and a deadline,
kill what it leaves, and (as root) the pool of per-run uids."""

from __future__ import annotations

import fcntl
import os
import random
import selectors
import signal
import subprocess
import time
from contextlib import contextmanager

SLOT_BASE_UID = 1_900_000_000  # far above any real account; uid = gid = base + slot
NUM_SLOTS = 256
_LOCK_DIR = "/tmp/grouprl-sandbox-slots"  # fixed (not $TMPDIR): every process on the host must agree


def execute(argv, stdin, pass_fd, uid, timeout_s, cap):
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
                kill_launcher(proc, uid)
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
                    kill_launcher(proc, uid)
                    hard_stop = time.monotonic() + 1.0
    finally:
        sel.close()
        kill_launcher(proc, uid)
        proc.stdout.close()
        proc.stderr.close()
        rc = proc.wait()
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), rc, stopped


def kill_launcher(proc, uid):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid:
        kill_uid(uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every live process whose real uid is `uid` until none is left (forks race the scan)."""
    for _ in range(100):
        found = False
        for name in os.listdir("/proc"):
            if name.isdigit() and live_uid(name) == uid:
                found = True
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        if not found:
            return
        time.sleep(0.01)


def live_uid(pid: str) -> int | None:
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
def claim_uid(per_run: bool = True):
    """Yield a sandbox uid no other run (thread or process) holds; 0 when not root or not `per_run`."""
    if not per_run or os.geteuid() != 0:
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
                kill_uid(uid)  # leftovers of a crashed earlier holder
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return
        time.sleep(0.05)
