import time

import pytest
from situation import become_subreaper, live_children


@pytest.fixture(autouse=True, scope="session")
def _subreaper():
    become_subreaper()


@pytest.fixture(autouse=True)
def no_process_outlives_a_test():
    """After every sandbox test no process started through it is alive (see situation.become_subreaper)."""
    before = set(live_children())
    yield
    deadline = time.monotonic() + 2.0  # SIGKILL is delivered asynchronously: a process may still be exiting
    while set(live_children()) - before and time.monotonic() < deadline:
        time.sleep(0.02)
    left = set(live_children()) - before
    assert not left, f"processes outlived the test: {[_cmdline(pid) for pid in sorted(left)]}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid}: (gone)"
