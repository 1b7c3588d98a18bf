"""Sandbox launcher: isolates itself, then execs the harness. Standard library only; never imports grouprl.

Started by `grouprl.sandbox.runner` as `python -I -S -B launch.py CONFIG_JSON`, in its own session
(process group), as the calling user. Steps in the two isolating modes:

1. unshare. "userns" (the caller is not root): a new user namespace in which uid/gid 1000 is the caller
   (one mapping, setgroups denied); the launcher holds capabilities over the namespaces it creates and
   none on the host. Both modes then get new mount, network, PID, IPC and UTS namespaces, and every
   mount is made private so nothing propagates back to the host.
2. fork: the child is PID 1 of the new PID namespace. When it exits the kernel kills every process left
   in the namespace, so no daemon outlives the run. At the deadline the caller kills the launcher's
   process group, the child with it; a child that left the group dies of its parent-death signal. The
   launcher waits and exits with the child's status (128 + signal when killed by a signal).
3. In the child, a new root on a tmpfs: read-only bind mounts of /usr, /bin, /sbin, /lib* and the
   interpreter's installation; a generated /etc (an account file naming only the sandbox user, the
   loader cache); /dev with null, zero, full, random, urandom; a fresh /proc (only the sandbox's
   processes); /tmp a tmpfs of disk_mb holding the working directory /tmp/work; /sandbox with the
   harness, program and test, read-only. Then pivot_root into it and detach the host's tree: no other
   host path exists for the program. "userns" also sets max_user_namespaces to 0 inside its namespace,
   so the program cannot nest one.
4. setrlimit (CPU, address space, processes, file size, open files, no core dumps); "namespace" drops
   to the run's dedicated uid/gid with no supplementary groups; parent-death signal SIGKILL, no_new_privs.
5. exec the harness with a clean environment. The exec runs as a non-zero uid without file
   capabilities, so it clears every capability the launcher held inside its namespaces.

"rlimit" mode (weak, opt-in) only does steps 4-5 in a host directory; the harness then blocks sockets
and process spawning with an audit hook. See docs/rewards.md.
"""

import ctypes
import json
import os
import platform
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
# statvfs flags that a remount inside a user namespace must keep (the kernel locks them), as mount flags
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

INNER_ID = 1000  # the sandbox's uid and gid inside a user namespace ("userns" mode)
NEW_ROOT = "/tmp"  # mount point of the new root's tmpfs, inside the private mount namespace only
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
DEVICES = ("null", "zero", "full", "random", "urandom")
SANDBOX_DIR = "/sandbox"  # harness, program and test: read-only
WORK_DIR = "/tmp/work"  # the program's working directory, on the size-limited tmpfs

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                      ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def _unshare(userns):
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _check(libc.unshare(flags | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{INNER_ID} {uid} 1"),
                           ("gid_map", f"{INNER_ID} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount("none", "/", None, MS_REC | MS_PRIVATE)


def _bind_ro(source, target):
    """Bind `source` at `target` read-only, keeping the flags the kernel locks on the source mount."""
    _mount(source, target, None, MS_BIND | MS_REC)
    kept = os.statvfs(target).f_flag
    flags = MS_NOSUID | MS_NODEV | sum(ms for st, ms in KEPT_FLAGS if kept & st)
    _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def _interpreter_dirs():
    """Host directories the interpreter needs, outside SYSTEM_DIRS: its installation prefix."""
    wanted = {os.path.dirname(os.path.realpath(sys.executable)), sys.base_prefix, sys.base_exec_prefix}
    dirs = []
    for path in sorted(os.path.realpath(p) for p in wanted):
        covered = any(path == d or path.startswith(d + "/") for d in list(SYSTEM_DIRS) + dirs)
        if path != "/" and os.path.isdir(path) and not covered:
            dirs.append(path)
    return dirs


def _write(path, data, mode):
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _mirror(path, root):
    """The host's `path` at root + path: a symbolic link copied as such, a directory or file bound read-only."""
    if os.path.islink(path):
        os.symlink(os.readlink(path), root + path)
    elif os.path.isdir(path):
        os.mkdir(root + path)
        _bind_ro(path, root + path)
    elif os.path.isfile(path):
        _write(root + path, b"", 0o644)
        _bind_ro(path, root + path)


def _build_root(cfg, files, userns):
    """Populate a tmpfs with the minimal view (module docstring, step 3) and pivot_root into it."""
    root = NEW_ROOT
    size_kb = 4096 + 2 * sum(len(d) for d in files.values()) // 1024
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_kb}k,mode=0755")
    for path in SYSTEM_DIRS:
        _mirror(path, root)
    for path in _interpreter_dirs():
        os.makedirs(root + path, 0o755)
        _bind_ro(path, root + path)
    os.mkdir(root + "/etc", 0o755)
    uid, gid = (INNER_ID, INNER_ID) if userns else (cfg["uid"], cfg["gid"])
    _write(root + "/etc/passwd", f"sandbox:x:{uid}:{gid}:sandbox:{WORK_DIR}:/bin/false\n".encode(), 0o644)
    _write(root + "/etc/group", f"sandbox:x:{gid}:\n".encode(), 0o644)
    _write(root + "/etc/hosts", b"127.0.0.1 localhost\n::1 localhost\n", 0o644)
    for path in ETC_FILES:
        _mirror(path, root)
    os.mkdir(root + "/dev", 0o755)
    for name in DEVICES:
        _write(root + "/dev/" + name, b"", 0o666)
        _mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", root + "/dev/fd")
    os.mkdir(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=1777")
    os.mkdir(root + "/proc")
    # A fresh /proc shows only this PID namespace. A container that masks parts of its own /proc may
    # refuse the mount to a user namespace; the program then runs without /proc rather than see the host's.
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.mkdir(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['disk_mb'])}m,mode=1777")
    os.mkdir(root + WORK_DIR, 0o700)
    if not userns:
        os.chown(root + WORK_DIR, uid, gid)
    os.mkdir(root + SANDBOX_DIR, 0o755)
    for name, data in files.items():
        _write(os.path.join(root + SANDBOX_DIR, name), data, 0o444)
    _mount("none", root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(root)
    _check(libc.syscall(number, b".", b"."), "pivot_root")  # the old root now sits on top of the new one
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _set_limits(cfg, userns):
    cpu = int(cfg["cpu_s"])
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1)]  # SIGXCPU at the soft limit (harness exits 124), SIGKILL 1 s later
    limits += [(which, value, value) for which, value in [
        (resource.RLIMIT_AS, int(cfg["as_bytes"])), (resource.RLIMIT_FSIZE, int(cfg["fsize_bytes"])),
        (resource.RLIMIT_NOFILE, int(cfg["nofile"])), (resource.RLIMIT_CORE, 0)]]
    nproc = int(cfg["nproc"])
    if not cfg["uid"] and not (userns and _nproc_counted_per_userns()):
        # RLIMIT_NPROC counts every process of the caller's uid: allow those already running plus the budget.
        nproc += _count_processes(os.getuid())
    limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def _nproc_counted_per_userns():
    """Since Linux 5.14 RLIMIT_NPROC counts the processes of a uid per user namespace (ucounts), so a
    run's budget covers only its own processes."""
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def _count_processes(uid):
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n


def _drop_privileges(cfg, isolated):
    uid, gid = cfg["uid"], cfg["gid"]
    if uid:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if isolated:
        _forbid_nested_userns(uid)
    # After the uid change (which clears it): die with the launcher.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def _forbid_nested_userns(uid):
    """Set max_user_namespaces to 0 in a user namespace of our own, so the program cannot create one
    (and gain capabilities over new namespaces: kernel attack surface, nothing more). In "userns" mode
    we are already in one; in "namespace" mode the run's uid makes one first (it owns it, as any user
    may). Best effort: where the kernel refuses user namespaces, the program cannot make one either."""
    if uid:
        if libc.unshare(CLONE_NEWUSER) != 0:
            return
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the uid change made /proc/self root's; writing the maps needs it ours
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{uid} {uid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError:
        pass  # no /proc (see _build_root)


def _exec_harness(cfg, harness_dir, work_dir, block):
    python = os.path.realpath(cfg["python"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work_dir, "TMPDIR": work_dir,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
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
    run_dir, mode = cfg["run_dir"], cfg["mode"]
    if mode in ("namespace", "userns"):
        files = {}
        for name in ["harness.py", "program.py"] + (["test.py"] if cfg["has_test"] else []):
            with open(os.path.join(run_dir, name), "rb") as f:
                files[name] = f.read()
        userns = mode == "userns"
        _unshare(userns)
        alive_r, alive_w = os.pipe()  # EOF on alive_r once the launcher is gone
        pid = os.fork()
        if pid:
            _wait_and_exit(pid)
        try:
            os.close(alive_w)
            _build_root(cfg, files, userns)
            _set_limits(cfg, userns)
            _drop_privileges(cfg, isolated=True)
            if select.select([alive_r], [], [], 0)[0]:  # the launcher died before the death signal was set
                os._exit(125)
            _exec_harness(cfg, SANDBOX_DIR, WORK_DIR, block=False)
        except BaseException as e:  # report, never fall through to the launcher's code path
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
            os._exit(125)
    elif mode == "rlimit":
        _set_limits(cfg, userns=False)
        _drop_privileges(cfg, isolated=False)
        _exec_harness(cfg, run_dir, os.path.join(run_dir, "work"), block=True)
    else:
        raise ValueError(f"unknown sandbox mode {mode!r}")


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:
        os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        os._exit(125)
