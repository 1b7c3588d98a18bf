"""Which sandbox is in force, the refusal when none isolates, the explicit weak mode, and failures of
the sandbox's own machinery (a CodeResult with status "sandbox_error", never a stray OSError).

Runs in every situation of situation.py."""

import logging
import os

import pytest
from situation import DOUBLE, DOUBLE_TESTS, EXPECT, FAST, OK, REFUSED

from grouprl.sandbox import SandboxUnavailableError, run_code, sandbox_mechanism
from grouprl.sandbox import runner

BLOCKED_SOCKET = ("import socket\ntry:\n    socket.socket()\n    print('open')\n"
                  "except PermissionError:\n    print('blocked')\n")
NO_NETWORK = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=0.5)\n"
              "except OSError:\n    print('no network')\n")


@pytest.fixture
def fresh_probe(monkeypatch):
    """Forget the probed mechanisms and the weak-mode warning; restore them afterwards."""
    monkeypatch.setattr(runner, "_probed", {})
    monkeypatch.setattr(runner, "_warned_weak", False)


def test_the_mechanism_in_force_is_the_expected_one():
    if REFUSED:
        with pytest.raises(SandboxUnavailableError) as err:
            sandbox_mechanism()
        msg = str(err.value)
        # what failed (here max_user_namespaces is 0: ENOSPC), how to get it, and the explicit way out
        assert "No space left on device" in msg and "seccomp=unconfined" in msg, msg
        assert "unprivileged_userns_clone" in msg and "GROUPRL_SANDBOX_MODE=rlimit" in msg and "isolation='weak'" in msg
    else:
        mech = sandbox_mechanism()
        assert (mech.mode, mech.weak) == (EXPECT, False)
        assert mech.describe().startswith(EXPECT)


def test_weak_isolation_only_when_asked_and_warned_once(fresh_probe, caplog):
    with caplog.at_level(logging.WARNING, logger="grouprl.sandbox"):
        first = run_code(DOUBLE, DOUBLE_TESTS, isolation="weak", **OK)
        second = run_code(NO_NETWORK, [{"input": "", "output": "no network"}], isolation="weak", **OK)
    assert (first.status, second.status) == ("passed", "passed")
    warnings = [r for r in caplog.records if "WEAK" in r.getMessage()]
    if REFUSED:  # no namespaces: the opt-in runs the weak sandbox, and says so once
        assert first.mechanism.startswith("rlimit") and len(warnings) == 1
        assert "seccomp=unconfined" in warnings[0].getMessage()
    else:  # namespaces work: "weak" only allows the fallback, it does not choose it
        assert first.mechanism.startswith(EXPECT) and warnings == []


def test_forced_rlimit_mode_blocks_sockets_and_warns(fresh_probe, monkeypatch, caplog):
    monkeypatch.setenv("GROUPRL_SANDBOX_MODE", "rlimit")
    with caplog.at_level(logging.WARNING, logger="grouprl.sandbox"):
        assert sandbox_mechanism().mode == "rlimit"
        assert run_code(BLOCKED_SOCKET, [{"input": "", "output": "blocked"}], **OK).status == "passed"
        assert run_code("while True: pass", [{"input": "", "output": ""}], **FAST).status == "timeout"
        res = run_code(DOUBLE, DOUBLE_TESTS + [{"input": "5", "output": "11"}], **OK)
    assert res.test_status == ["passed", "passed", "failed"]
    assert [r.getMessage() for r in caplog.records if "WEAK" in r.getMessage()] == [
        f"grouprl sandbox: untrusted code runs with {sandbox_mechanism().describe()}. "
        "Forced by GROUPRL_SANDBOX_MODE=rlimit."]


def test_a_forced_isolating_mode_that_cannot_work_is_refused_not_weakened(fresh_probe, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root can create every namespace; the refusal is checked as an unprivileged uid")
    monkeypatch.setenv("GROUPRL_SANDBOX_MODE", "namespace")  # root's mode, asked for without root
    with pytest.raises(SandboxUnavailableError, match="namespace with .*sandbox setup failed"):
        sandbox_mechanism("weak")


def test_bad_mode_and_isolation_values_name_the_choices(fresh_probe, monkeypatch):
    with pytest.raises(ValueError, match="isolation='none'.*'strict'.*'weak'"):
        run_code(DOUBLE, DOUBLE_TESTS, isolation="none")
    monkeypatch.setenv("GROUPRL_SANDBOX_MODE", "chroot")
    with pytest.raises(ValueError, match="GROUPRL_SANDBOX_MODE='chroot'.*auto, namespace, userns, rlimit"):
        sandbox_mechanism()


def test_machinery_failures_are_sandbox_errors(monkeypatch, tmp_path):
    mode = "rlimit" if REFUSED else EXPECT
    python = os.path.realpath(os.sys.executable)
    # the interpreter is gone
    res = runner._run_tests(DOUBLE, DOUBLE_TESTS, 1.5, 128, 1 << 16, 8, mode, str(tmp_path / "no-python"))
    assert (res.status, res.test_status) == ("sandbox_error", ["sandbox_error", "not_run"])
    assert "FileNotFoundError" in res.detail and "no-python" in res.detail
    # no temporary directory can be made
    monkeypatch.setattr(runner.tempfile, "tempdir", str(tmp_path / "missing"))
    res = runner._run_tests(DOUBLE, DOUBLE_TESTS, 1.5, 128, 1 << 16, 8, mode, python)
    assert res.status == "sandbox_error" and "missing" in res.detail
    # and an unknown mode reaches the launcher, which reports instead of running anything
    monkeypatch.undo()
    res = runner._run_tests(DOUBLE, DOUBLE_TESTS, 1.5, 128, 1 << 16, 8, "chroot", python)
    assert res.status == "sandbox_error" and "unknown sandbox mode 'chroot'" in res.detail
