"""The sandbox suite again, as an unprivileged user: with user namespaces, and without them (refused).

Most people who train do not run as root, so test_sandbox.py, test_modes.py and test_program.py run
twice more here, each in a child pytest:
- as uid 65534 with RLIMIT_NPROC set (root ignores it), where user namespaces are allowed: the
  sandbox must give the same containment as root ("userns");
- as an unprivileged uid inside no_userns.py, where user namespaces cannot be made (as under
  Docker's default seccomp profile): every run must be refused, with the fix in the message.

The child runs from a copy (a world-readable temporary directory holding grouprl.sandbox, the tests
and pytest with its dependencies), since the checkout or the interpreter may sit where the uid cannot
read (here the venv's interpreter lives under /root, mode 0700).
"""

import importlib.metadata
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import grouprl

UID = 65534  # nobody
NPROC = 512  # the uid's whole process budget, for the sandboxes and the child pytest together
HERE = Path(__file__).parent
TESTS = ["test_sandbox.py", "test_modes.py", "test_program.py"]


def _copy_tree(dest: Path) -> None:
    pkg = Path(grouprl.__file__).parent
    (dest / "src/grouprl/sandbox").mkdir(parents=True)
    shutil.copy(pkg / "__init__.py", dest / "src/grouprl")
    for f in (pkg / "sandbox").glob("*.py"):
        shutil.copy(f, dest / "src/grouprl/sandbox")
    (dest / "tests").mkdir()
    for name in TESTS + ["situation.py", "conftest.py", "no_userns.py"]:
        shutil.copy(HERE / name, dest / "tests")
    todo, seen = ["pytest"], set()
    while todo:  # pytest and what it requires on this interpreter
        dist = importlib.metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for f in dist.files or []:
            src = Path(f.locate())
            if ".." not in f.parts and src.is_file():
                (dest / "site" / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest / "site" / f)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _as_user(uid: int | None) -> dict:
    """Popen arguments that run the child as `uid` (None: as we are) with the process cap."""
    def cap():
        resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))

    if uid is None:
        return {"preexec_fn": cap}
    return {"user": uid, "group": uid, "extra_groups": [], "preexec_fn": cap}


def _interpreter(tree: Path, uid: int | None) -> str | None:
    """The first interpreter that `uid` can run and that imports pytest from the copy."""
    for python in dict.fromkeys([os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]):
        try:
            ok = subprocess.run([python, "-c", "import pytest, grouprl.sandbox"], env=_env(tree, tree),
                                capture_output=True, **_as_user(uid)).returncode == 0
        except OSError:  # not there, or not executable by uid
            ok = False
        if ok:
            return python
    return None


def _env(tree: Path, home: Path, **extra) -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
            "PYTHONPATH": f"{tree}/src:{tree}/site", "PYTHONDONTWRITEBYTECODE": "1", **extra}


@pytest.fixture
def open_tmp():
    """A temporary directory others may traverse (pytest's own tmp_path sits in a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="grouprl-unpriv-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _prepare(tmp: Path, uid: int | None) -> tuple[Path, Path, str]:
    """The copy, a directory the child owns (its HOME and pytest's basetemp), and the interpreter."""
    tree, work = tmp / "tree", tmp / "work"
    _copy_tree(tree)
    work.mkdir()
    if uid is not None:
        os.chown(work, uid, uid)
    python = _interpreter(tree, uid)
    if python is None:
        pytest.skip(f"no interpreter that uid {uid} can run imports the copied pytest")
    return tree, work, python


def _run_suite(tree: Path, work: Path, python: str, uid: int | None, expect: str, no_userns: bool = False) -> None:
    argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--basetemp={work}/basetemp", *TESTS]
    if no_userns:
        argv = [python, str(tree / "tests" / "no_userns.py"), *argv]
    proc = subprocess.run(argv, cwd=tree / "tests", capture_output=True, text=True, timeout=600,
                          env=_env(tree, work, GROUPRL_TEST_SANDBOX_EXPECT=expect), **_as_user(uid))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s( \(.*\))?", summary), out[-4000:]  # nothing failed or skipped


@pytest.mark.slow
def test_suite_as_an_unprivileged_user_with_user_namespaces(open_tmp):
    if os.geteuid() != 0:
        pytest.skip("this pytest already runs unprivileged (test_sandbox.py ran as userns); root switches uid here")
    tree, work, python = _prepare(open_tmp, UID)
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x10000000) != 0)"
    if subprocess.run([python, "-c", probe], env=_env(tree, work), **_as_user(UID)).returncode != 0:
        pytest.skip(f"this kernel refuses user namespaces to uid {UID}: the refusal run covers this host")
    _run_suite(tree, work, python, UID, "userns")


@pytest.mark.slow
def test_suite_refused_without_user_namespaces(open_tmp):
    uid = UID if os.geteuid() == 0 else None
    tree, work, python = _prepare(open_tmp, uid)
    _run_suite(tree, work, python, uid, "refuse", no_userns=True)
