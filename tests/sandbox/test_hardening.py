"""What only root can check: "userns" mode run by root, a run without a per-run uid to sweep, and the
slot lock directory under /tmp.

Root only (the unprivileged situations run test_sandbox.py, test_modes.py and test_program.py).
"""

import contextlib
import fcntl
import os

import pytest
from situation import COUNT_CHILDREN, ESCAPE, OK, live_children, outlivers

from grouprl.sandbox import process, run_code, sandbox_mechanism
from grouprl.sandbox import runner

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="root only")


@pytest.fixture
def userns_as_root(monkeypatch):
    """GROUPRL_SANDBOX_MODE=userns, probed afresh."""
    monkeypatch.setenv("GROUPRL_SANDBOX_MODE", "userns")
    monkeypatch.setattr(runner, "_probed", {})


@pytest.fixture
def no_run_uid(monkeypatch):
    """Runs get no per-run uid (as in userns mode without root): no sweep by uid is left to kill anything."""
    @contextlib.contextmanager
    def no_uid(per_run=True):
        yield 0

    monkeypatch.setattr(runner, "claim_uid", no_uid)


def test_root_in_userns_mode_runs_the_program_as_a_per_run_uid_so_the_process_budget_holds(userns_as_root):
    mech = sandbox_mechanism()
    assert mech.mode == "userns" and mech.describe().startswith("userns (namespaces inside a user namespace, "
                                                                 "a per-run uid (root))")
    res = run_code(COUNT_CHILDREN + "import os\nprint(os.getuid())\n", [{"input": "", "output": "-1"}], **OK)
    children, uid = res.detail.split("got '")[1].rstrip("'").split("\\n")
    assert 0 < int(children) < runner.NPROC and uid == "1000", res.detail


def test_the_pid_namespace_alone_ends_a_program_that_outlives_its_group(userns_as_root, no_run_uid):
    before = set(live_children())
    res = run_code(ESCAPE, [{"input": "", "output": ""}], timeout_s=1.5, memory_mb=128)
    assert res.status == "timeout"
    assert outlivers(before) == []


@pytest.fixture
def lock_dir(monkeypatch, tmp_path):
    sandbox_mechanism()  # probed with the real directory
    path = tmp_path / "slots"
    monkeypatch.setattr(process, "_LOCK_DIR", str(path))
    return path


def test_a_lock_directory_that_is_not_ours_is_refused_not_used(lock_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    lock_dir.symlink_to(victim)
    res = run_code("print(1)", [{"input": "", "output": "1"}], **OK)
    assert res.status == "sandbox_error" and "is not a directory" in res.detail
    assert list(victim.iterdir()) == []
    lock_dir.unlink()
    lock_dir.mkdir(mode=0o700)
    os.chown(lock_dir, 65534, 65534)
    res = run_code("print(1)", [{"input": "", "output": "1"}], **OK)
    assert res.status == "sandbox_error" and "owner uid 65534 and mode 700" in res.detail
    os.chown(lock_dir, 0, 0)
    lock_dir.chmod(0o777)
    res = run_code("print(1)", [{"input": "", "output": "1"}], **OK)
    assert res.status == "sandbox_error" and "mode 777" in res.detail
    lock_dir.chmod(0o700)
    assert run_code("print(1)", [{"input": "", "output": "1"}], **OK).status == "passed"


def test_every_slot_held_is_a_sandbox_error_after_the_claim_timeout(lock_dir, monkeypatch):
    monkeypatch.setattr(process, "NUM_SLOTS", 2)
    monkeypatch.setattr(process, "CLAIM_TIMEOUT_S", 0.2)
    lock_dir.mkdir(mode=0o700)
    held = [os.open(lock_dir / f"slot-{i}.lock", os.O_CREAT | os.O_RDWR, 0o600) for i in range(2)]
    try:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        res = run_code("print(1)", [{"input": "", "output": "1"}], **OK)
    finally:
        for fd in held:
            os.close(fd)
    assert res.status == "sandbox_error" and "all 2 slots" in res.detail


def test_a_32_bit_python_on_a_64_bit_kernel_gets_no_seccomp_filter_of_the_kernels_abi():
    """platform.machine() names the kernel's machine; a 32-bit Python there makes its syscalls in the
    other ABI, every one of which the memory filter refuses: the launcher would fail at its next call.
    Such a Python gets no filter (the memfd gap stays, as on machines the filter does not know). Run in a
    process of its own, with sys.maxsize made a 32-bit Python's; before the guard, the filter went in."""
    import subprocess
    import sys

    script = ("import os, sys; sys.maxsize = 2**31 - 1\n"
              "from grouprl.sandbox import launch\n"
              "launch.libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, as the launcher sets it first\n"
              "launch._deny_unbounded_memory()\n"
              "os.close(os.memfd_create('probe')); print('no filter')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "no filter", done.stderr
