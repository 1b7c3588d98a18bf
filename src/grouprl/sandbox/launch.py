"""Sandbox launcher: isolates itself, then execs the harness. Standard library only; never imports grouprl.

Started by `grouprl.sandbox.runner` as `python -I -S -B launch.py CONFIG_JSON`, in its own session
(process group), as the calling user, with stdin a pipe and a private status pipe (`status_fd`): a setup
failure is reported there, never on stdout or stderr, which the program shares. Steps in the two
isolating modes:

1. unshare. "userns": a new user namespace in which uid/gid 1000 is the caller (not root: one mapping,
   setgroups denied), or, for root, the run's claimed uid (a helper process left outside writes the
   maps, which takes privilege; root itself stays uid 0 there for the setup); the launcher holds
   capabilities over the namespaces it creates and none on the host. Both modes then get new mount,
   network, PID, IPC and UTS namespaces, and every mount is made private so nothing propagates back.
2. fork: the child is PID 1 of the new PID namespace, our own init, with SIGKILL as its parent-death
   signal. It forks the harness (step 5) and reaps until the harness exits, then exits with its
   status; when it exits the kernel kills every process left in the namespace. At the deadline the
   caller kills the launcher's process group: the init dies with the launcher whatever the program did
   (it cannot signal its PID 1 nor clear the init's death signal), and the whole namespace with it.
   The launcher waits and exits with the init's status (128 + signal when killed by a signal).
3. In the init, a new root on a tmpfs: read-only bind mounts of /usr, /bin, /sbin, /lib* and the
   interpreter's installation; a generated /etc (an account file naming only the sandbox user, the
   loader cache); /dev with null, zero, full, random, urandom; a fresh /proc (only the sandbox's
   processes); /tmp a tmpfs of disk_mb holding the working directory /tmp/work; /sandbox with the
   harness, program and test, read-only. Then pivot_root into it and detach the host's tree: no other
   host path exists for the program.
4. In the harness's process: setrlimit (CPU, address space, processes, file size, open files, no core
   dumps); drop to the run's uid/gid with no supplementary groups (namespace mode, and userns as root);
   max_user_namespaces 0 in a user namespace of its own, so the program cannot nest one; parent-death
   signal SIGKILL, no_new_privs; a seccomp filter refusing memfd_create, memfd_secret and shmget, whose
   memory RLIMIT_AS does not count.
5. exec the harness with a clean environment. The exec runs as a non-zero uid without file
   capabilities, so it clears every capability held inside the namespaces.

"rlimit" mode (weak, opt-in) only does steps 4-5 in a host directory; the harness then blocks sockets
and process spawning with an audit hook. See docs/rewards.md.
"""

import ctypes
import errno
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
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SECCOMP_MODE_FILTER = 2
# The seccomp filter's machines: (AUDIT_ARCH_*, memfd_create, shmget); memfd_secret is 447 on each
SECCOMP_ARCH = {"x86_64": (0xC000003E, 319, 29), "aarch64": (0xC00000B7, 279, 194), "riscv64": (0xC00000F3, 279, 194)}
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
# Files and folders a writable tmpfs of the sandbox holds at most (/tmp, /dev/shm). `size=` bounds their
# data only: an empty file is kernel memory (inode, name), and with the default count (half of RAM in
# pages) a program creating empty files grew the host's slab by ~1 GiB in 6 s, past disk_mb and
# RLIMIT_AS. Past this a create fails with ENOSPC, as on a full disk.
MAX_FILES = 4096

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                      ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def _unshare(userns, run_uid, run_gid):
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not userns:
        _check(libc.unshare(flags), "unshare")
    elif not run_uid:  # not root: the one mapping allowed without privileges, the caller's own ids
        uid, gid = os.getuid(), os.getgid()  # inside the namespace they read as unmapped until the maps exist
        _check(libc.unshare(flags | CLONE_NEWUSER), "unshare")
        _write_maps("self", f"{INNER_ID} {uid} 1", f"{INNER_ID} {gid} 1", deny_setgroups=True)
    else:
        # Root: the sandbox user is the run's claimed uid, since RLIMIT_NPROC does not bind kernel uid 0;
        # root keeps uid 0 for the setup. Mapping ids other than one's own takes CAP_SETUID outside the
        # new namespace, so a helper forked before the unshare writes the maps.
        go_r, go_w = os.pipe()
        launcher = os.getpid()
        helper = os.fork()
        if helper == 0:
            try:
                os.close(go_w)
                if os.read(go_r, 1) == b"x":
                    _write_maps(launcher, f"0 0 1\n{INNER_ID} {run_uid} 1", f"0 0 1\n{INNER_ID} {run_gid} 1")
                    os._exit(0)
            except BaseException:
                pass
            os._exit(1)
        os.close(go_r)
        try:
            _check(libc.unshare(flags | CLONE_NEWUSER), "unshare")
            os.write(go_w, b"x")
        finally:
            os.close(go_w)
            _, status = os.waitpid(helper, 0)
        if status != 0:
            raise OSError(f"could not map uid {INNER_ID} of the sandbox to the run's uid {run_uid}")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)


def _write_maps(pid, uid_map, gid_map, deny_setgroups=False):
    for name, text in (("setgroups", "deny" if deny_setgroups else ""), ("uid_map", uid_map), ("gid_map", gid_map)):
        if text:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(text)


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
    uid, gid = _sandbox_ids(cfg, userns)
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
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size=1m,nr_inodes={MAX_FILES},mode=1777")
    os.mkdir(root + "/proc")
    # A fresh /proc shows only this PID namespace. A container that masks parts of its own /proc may
    # refuse the mount to a user namespace; the program then runs without /proc rather than see the host's.
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.mkdir(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={int(cfg['disk_mb'])}m,nr_inodes={MAX_FILES},mode=1777")
    os.mkdir(root + WORK_DIR, 0o700)
    if cfg["uid"]:  # we are root; the program will run as the run's uid
        os.chown(root + WORK_DIR, uid, gid)
    os.mkdir(root + SANDBOX_DIR, 0o755)
    for name, data in files.items():
        _write(os.path.join(root + SANDBOX_DIR, name), data, 0o444)
    _mount("none", root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    number = SYS_PIVOT_ROOT.get(platform.machine()) if sys.maxsize > 2**32 else None  # (a 32-bit ABI's differ)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(root)
    _check(libc.syscall(number, b".", b"."), "pivot_root")  # the old root now sits on top of the new one
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def _no_shared_memory():
    """SysV shared memory is not counted by RLIMIT_AS: a segment written and then detached held 300 MiB
    under a 64 MiB memory_mb. Its limits belong to the IPC namespace just made: set to 0 there, every
    shmget fails. Root only: an unprivileged user namespace, whose uid 0 is not mapped, cannot write
    them, and the kernel's defaults stay (docs/rewards.md)."""
    for name in ("shmmax", "shmall"):
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as f:  # the writer's IPC namespace's, whichever /proc
                f.write("0")
        except OSError:
            pass


def _sandbox_ids(cfg, userns):
    """The program's uid and gid as seen inside the sandbox."""
    return (INNER_ID, INNER_ID) if userns else (cfg["uid"], cfg["gid"])


def _set_limits(cfg, userns, running):
    cpu = int(cfg["cpu_s"])
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1)]  # SIGXCPU at the soft limit (harness exits 124), SIGKILL 1 s later
    limits += [(which, value, value) for which, value in [
        (resource.RLIMIT_AS, int(cfg["as_bytes"])), (resource.RLIMIT_FSIZE, int(cfg["fsize_bytes"])),
        (resource.RLIMIT_NOFILE, int(cfg["nofile"])), (resource.RLIMIT_CORE, 0)]]
    nproc = int(cfg["nproc"])
    if not cfg["uid"]:
        # RLIMIT_NPROC counts the caller's processes: in the run's user namespace only (Linux >= 5.14), where
        # our launcher and init are two of them; else all of them, so the budget goes on top of those.
        nproc += 2 if userns and _nproc_counted_per_userns() else running
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


def _drop_privileges(uid, gid, isolated):
    """Become `uid` (0: stay who we are, the caller's uid in "userns" without root)."""
    if uid:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if isolated:
        _forbid_nested_userns(uid)
    # After the uid change (which clears it): die with our parent (the init, or the caller in "rlimit").
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _deny_unbounded_memory()


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _deny_unbounded_memory():
    """A seccomp filter under which memfd_create, memfd_secret and shmget fail with EPERM: memory they
    hold is outside the address space RLIMIT_AS bounds (a memfd is a file of up to RLIMIT_FSIZE, one per
    open file, in each process). Also refused: syscalls of another ABI (i386's int 0x80, x32), whose
    numbers differ. Needs no_new_privs, and is kept across fork and exec. On a machine not in
    SECCOMP_ARCH, or a kernel without seccomp filters (EINVAL), the gap stays (docs/rewards.md)."""
    # the kernel's machine; a 32-bit Python on it (a 32-bit userland on a 64-bit kernel) makes its
    # syscalls in the other ABI, which this filter would refuse, every one
    arch = SECCOMP_ARCH.get(platform.machine()) if sys.maxsize > 2**32 else None
    if arch is None:
        return
    audit_arch, memfd_create, shmget = arch
    ld_word, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    program = [
        (ld_word, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, audit_arch),
        (ret, 0, 0, deny),  # another ABI
        (ld_word, 0, 0, 0),  # seccomp_data.nr
        (jge, 4, 0, 0x40000000),  # x32's numbers (__X32_SYSCALL_BIT)
        (jeq, 3, 0, memfd_create),
        (jeq, 2, 0, 447),  # memfd_secret
        (jeq, 1, 0, shmget),
        (ret, 0, 0, allow),
        (ret, 0, 0, deny),
    ]
    filters = (_SockFilter * len(program))(*(_SockFilter(*op) for op in program))
    fprog = _SockFprog(len(program), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        if ctypes.get_errno() != errno.EINVAL:
            _check(-1, "prctl(SET_SECCOMP)")


def _forbid_nested_userns(uid):
    """Set max_user_namespaces to 0 in a user namespace of our own, so the program cannot create one
    (and gain capabilities over new namespaces: kernel attack surface, nothing more). Without a uid change
    ("userns", not root) we own the one we are in; after one, the run's uid makes one first (it owns it,
    as any user may). Best effort: where the kernel refuses user namespaces, the program cannot make one either."""
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
    argv = [python, "-I", "-S", "-B", os.path.join(harness_dir, "harness.py"), str(cfg["status_fd"]),
            str(cfg["nonce_fd"]), os.path.join(harness_dir, "program.py"),
            os.path.join(harness_dir, "test.py") if cfg["has_test"] else "", "1" if block else "0"]
    os.execve(python, argv, env)


def _exit_like(status):
    """Exit as a process that ended with wait `status` did (128 + signal when a signal killed it)."""
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _init(harness):
    """PID 1 of the sandbox: reap every orphan until the harness exits, then exit with its status (the kernel
    then kills whatever is left in the namespace). PID 1 receives from inside its namespace only the
    signals it handles: none, once SIGINT has its default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == harness:
            _exit_like(status)


def _die_with_caller(cfg):
    """The launcher dies with the process that started it (a trainer killed, or exiting with a tool call
    still running): without this the launcher, the init and the program lived on, reparented to PID 1
    (the program's deadline is kept by the caller). Its death takes the init (whose death signal is
    the launcher's) and so the whole PID namespace. Set after the unshare, which may change our
    credentials and with them clear the signal; a caller gone before it was set is seen by getppid."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != cfg.get("caller_pid", os.getppid()):
        os._exit(125)


def _fail(status_fd, e):
    """Report a setup failure on the private status pipe, never fall through to the caller's code path."""
    try:
        os.write(status_fd, f"sandbox setup failed: {e!r}"[:4000].encode("utf-8", "replace"))
    finally:
        os._exit(125)


def main(cfg):
    run_dir, mode, status_fd = cfg["run_dir"], cfg["mode"], cfg["status_fd"]
    userns = mode == "userns"
    running = 0
    if not cfg["uid"] and not (userns and _nproc_counted_per_userns()):
        running = _count_processes(os.getuid())  # on the host's /proc, before pivot_root
    if mode == "rlimit":
        _set_limits(cfg, userns=False, running=running)
        _drop_privileges(cfg["uid"], cfg["gid"], isolated=False)
        _exec_harness(cfg, run_dir, os.path.join(run_dir, "work"), block=True)
    if mode not in ("namespace", "userns"):
        raise ValueError(f"unknown sandbox mode {mode!r}")
    files = {}
    for name in ["harness.py", "program.py"] + (["test.py"] if cfg["has_test"] else []):
        with open(os.path.join(run_dir, name), "rb") as f:
            files[name] = f.read()
    _unshare(userns, cfg["uid"], cfg["gid"])
    _die_with_caller(cfg)
    _no_shared_memory()
    alive_r, alive_w = os.pipe()  # EOF on alive_r once the launcher is gone
    init = os.fork()
    if init:
        os.close(status_fd)  # only the sandbox reports from here on
        _, status = os.waitpid(init, 0)
        _exit_like(status)
    os.close(alive_w)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # our uid never changes, so this stays
    if select.select([alive_r], [], [], 0)[0]:  # the launcher died before the death signal was set
        os._exit(125)
    _build_root(cfg, files, userns)
    harness = os.fork()
    if harness == 0:
        try:
            _set_limits(cfg, userns, running)
            uid, gid = _sandbox_ids(cfg, userns) if cfg["uid"] else (0, 0)
            _drop_privileges(uid, gid, isolated=True)
            _exec_harness(cfg, SANDBOX_DIR, WORK_DIR, block=False)
        except BaseException as e:
            _fail(status_fd, e)
    os.close(status_fd)
    _init(harness)


if __name__ == "__main__":
    fd = 2  # until the config names the status pipe
    try:
        config = json.loads(sys.argv[1])
        fd = config["status_fd"]
        main(config)
    except BaseException as err:
        _fail(fd, err)
