"""Process handling for the sandbox: start the launcher, read its output with a cap and a deadline,
kill what it leaves, and (as root) the pool of per-run uids."""

from __future__ import annotations

import fcntl
import os
import random
import selectors
import signal
import stat
import subprocess
import threading
import time
from contextlib import contextmanager

SLOT_BASE_UID = 1_900_000_000  # far above any real account; uid = gid = base + slot
NUM_SLOTS = 256
_LOCK_DIR = "/tmp/grouprl-sandbox-slots"  # fixed (not $TMPDIR): every process on the host must agree
CLAIM_TIMEOUT_S = 60.0


def execute(argv, stdin, pass_fds, uid, timeout_s, caps):
    """Start the launcher, feed it the bytes `stdin` through a pipe, read stdout/stderr until it exits or
    the deadline.

    caps: the most bytes read of (stdout, stderr); past either the run is stopped ("output_limit").
    Returns (stdout, stderr, returncode, stopped) where stopped is "timeout", "output_limit" or "".
    Whatever happens, the process group and every process of `uid` are killed before returning.
    """
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
        start_new_session=True, env=env, cwd="/",
    )
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    cap = {out_fd: caps[0], err_fd: caps[1]}
    todo = memoryview(stdin)
    stopped = ""
    deadline = time.monotonic() + timeout_s
    hard_stop = None  # after a kill or exit, stop waiting for EOF at this time
    sel = selectors.DefaultSelector()
    try:
        for f in (proc.stdout, proc.stderr):
            sel.register(f, selectors.EVENT_READ)
        if todo:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while True:
            now = time.monotonic()
            if hard_stop is not None and now >= hard_stop:
                break
            if hard_stop is None and now >= deadline:
                stopped = "timeout"
                kill_launcher(proc, uid)
                hard_stop = now + 1.0
            elif hard_stop is None and proc.poll() is not None:
                hard_stop = now + 0.5  # exited: drain what is left, then kill anything holding the pipes
            if not any(k.events == selectors.EVENT_READ for k in sel.get_map().values()):
                if hard_stop is not None:
                    break  # ended, and both pipes at EOF
                if not sel.get_map():  # both at EOF, all stdin written: wait for the exit (or the deadline)
                    try:
                        proc.wait(timeout=deadline - now)
                    except subprocess.TimeoutExpired:
                        pass
                    continue
            for key, _ in sel.select(timeout=0.05):
                if key.fileobj is proc.stdin:
                    try:
                        todo = todo[os.write(key.fd, todo[: 1 << 16]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # the sandbox closed its end: the rest is not wanted
                        todo = todo[:0]
                    if not todo:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.fd]
                room = cap[key.fd] - len(buf)
                buf += data[:room]
                if len(data) > room and not stopped:
                    stopped = "output_limit"
                    kill_launcher(proc, uid)
                    hard_stop = time.monotonic() + 1.0
    finally:
        sel.close()
        kill_launcher(proc, uid)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        rc = proc.wait()
        reap_group(proc.pid)
    return bytes(bufs[out_fd]), bytes(bufs[err_fd]), rc, stopped


def reap_group(pgid):
    """Reap the launcher's orphans that were handed to us: when the launcher is killed, its child (the
    sandbox's init, in the launcher's process group) goes to the nearest subreaper, which is this
    process when it is a container's PID 1 or a subreaper, and would stay a zombie. Only children in
    the group `pgid` are waited for (no other child's exit status is taken); one still dying is waited
    for in a daemon thread. Elsewhere the init went to another process, and this finds nothing."""
    while True:
        try:
            if os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is None:  # one is still dying
                break
        except ChildProcessError:  # none of ours left in the group
            return
    threading.Thread(target=_wait_group, args=(pgid,), daemon=True, name=f"reap-{pgid}").start()


def _wait_group(pgid):
    try:
        while True:
            os.waitid(os.P_PGID, pgid, os.WEXITED)
    except ChildProcessError:
        pass


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
    """Yield a sandbox uid no other run (thread or process) holds; 0 when not root or not `per_run`.

    Raises OSError when the lock directory is not safely ours, or when every slot stays held for
    CLAIM_TIMEOUT_S (the caller reports it as a sandbox_error rather than wait forever)."""
    if not per_run or os.geteuid() != 0:
        yield 0
        return
    dir_fd = _open_lock_dir()
    try:
        deadline = time.monotonic() + CLAIM_TIMEOUT_S
        while True:
            for slot in random.sample(range(NUM_SLOTS), NUM_SLOTS):
                fd = os.open(f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
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
            if time.monotonic() >= deadline:
                raise OSError(f"no free sandbox uid: all {NUM_SLOTS} slots in {_LOCK_DIR} were held "
                              f"for {CLAIM_TIMEOUT_S:g} s")
            time.sleep(0.05)
    finally:
        os.close(dir_fd)


def _open_lock_dir() -> int:
    """The slot lock directory, opened without following a link, once it is root's and mode 0700: its path is
    fixed under a world-writable /tmp, so whoever made it first would otherwise own our locks."""
    try:
        os.mkdir(_LOCK_DIR, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(_LOCK_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise OSError(f"{_LOCK_DIR} is not a directory ({e.strerror}): remove it") from e
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        os.close(fd)
        raise OSError(f"{_LOCK_DIR} has owner uid {st.st_uid} and mode {stat.S_IMODE(st.st_mode):o}, "
                      f"not ours and 700: remove it")
    return fd
