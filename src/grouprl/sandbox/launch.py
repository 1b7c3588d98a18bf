"""Sandbox launcher: runs as the calling user (root in our CI), isolates, drops privileges, execs the harness.

Started by `grouprl.sandbox.runner` as `python -I -S -B launch.py CONFIG_JSON`, in its own
session (process group). Standard library only: it never imports grouprl. Steps in "namespace" mode:

1. unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID): a private mount table, a network namespace with
   only a downed loopback (no route anywhere), and a PID namespace whose init is the program.
2. fork: the child is PID 1 of the new namespace. When it exits the kernel kills every process left in
   the namespace, so no daemon outlives the run. The launcher waits and exits with the child's status
   (128 + signal when killed by a signal).
3. In the child: mount a fresh /proc (host processes become invisible), a size-limited tmpfs on /tmp
   (the working directory /tmp/work lives there and vanishes with the namespace), small tmpfs over the
   other world-writable directories, /dev/null over the user and group databases.
4. setrlimit (CPU, address space, processes, file size, open files, no core dumps), drop to the
   dedicated sandbox uid/gid with no supplementary groups, parent-death signal SIGKILL, no_new_privs.
5. exec the harness with a clean environment.

"rlimit" mode (no namespaces available) only does steps 4-5; the harness then blocks sockets and
process spawning with an audit hook. See docs/rewards.md.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SANDBOX_DIR = "/tmp/.sandbox"  # inside the private tmpfs: harness + program, read-only to the sandbox uid
WORK_DIR = "/tmp/work"  # the program's working directory, owned by the sandbox uid
OTHER_WRITABLE = ("/var/tmp", "/run/lock", "/var/lock", "/dev/shm", "/dev/mqueue")
HIDDEN_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow")

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _unshare_all():
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    # Make every mount private first, so nothing we mount propagates back to the host.
    _mount("none", "/", None, MS_REC | MS_PRIVATE)


def _set_limits(cfg):
    cpu = int(cfg["cpu_s"])
    limits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit (harness exits 124), SIGKILL 1 s later
    ]
    limits += [
        (which, value, value)
        for which, value in [
            (resource.RLIMIT_AS, int(cfg["as_bytes"])),
            (resource.RLIMIT_FSIZE, int(cfg["fsize_bytes"])),
            (resource.RLIMIT_NOFILE, int(cfg["nofile"])),
            (resource.RLIMIT_CORE, 0),
        ]
    ]
    nproc = int(cfg["nproc"])
    if not cfg["uid"]:
        # Without a dedicated uid RLIMIT_NPROC counts every process of the caller's uid: allow those
        # already running plus the budget.
        nproc += _count_processes(os.getuid())
    limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _count_processes(uid):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n


def _drop_privileges(cfg):
    uid, gid = cfg["uid"], cfg["gid"]
    if uid:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    # After the uid change (which clears it): die with the launcher.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def _prepare_filesystem(cfg, files):
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['disk_mb'])}m,mode=1777")
    for path in OTHER_WRITABLE:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=1777")
    for path in HIDDEN_FILES:
        if os.path.isfile(path):
            _mount("/dev/null", path, None, MS_BIND)
    os.mkdir(SANDBOX_DIR, 0o755)
    for name, data in files.items():
        with open(os.path.join(SANDBOX_DIR, name), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(SANDBOX_DIR, name), 0o444)
    os.mkdir(WORK_DIR, 0o700)
    os.chown(WORK_DIR, cfg["uid"], cfg["gid"])


def _exec_harness(cfg, harness_dir, work_dir, block):
    python = cfg["python"]
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": work_dir,
        "TMPDIR": work_dir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    os.chdir(work_dir)
    argv = [python, "-I", "-S", "-B", os.path.join(harness_dir, "harness.py"), str(cfg["nonce_fd"]),
            os.path.join(harness_dir, "program.py"),
            os.path.join(harness_dir, "test.py") if cfg["has_test"] else "", "1" if block else "0"]
    os.execve(python, argv, env)


def _wait_and_exit(pid):
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def main():
    cfg = json.loads(sys.argv[1])
    run_dir = cfg["run_dir"]
    if cfg["mode"] == "namespace":
        names = ["harness.py", "program.py"] + (["test.py"] if cfg["has_test"] else [])
        files = {}
        for name in names:
            with open(os.path.join(run_dir, name), "rb") as f:
                files[name] = f.read()
        _unshare_all()
        pid = os.fork()
        if pid:
            _wait_and_exit(pid)
        try:
            _prepare_filesystem(cfg, files)
            _set_limits(cfg)
            _drop_privileges(cfg)
            _exec_harness(cfg, SANDBOX_DIR, WORK_DIR, block=False)
        except BaseException as e:  # report, never fall through to the launcher's code path
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
            os._exit(125)
    else:
        _set_limits(cfg)
        _drop_privileges(cfg)
        _exec_harness(cfg, run_dir, os.path.join(run_dir, "work"), block=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:
        os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        os._exit(125)
