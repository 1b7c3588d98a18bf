"""Without OpenEnv installed, the adapter's import fails with the extra to install (runs with or
without openenv-core: with it, its absence is simulated)."""

import importlib
import re
import sys

import pytest


def test_a_missing_openenv_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("openenv.")]:
        monkeypatch.setitem(sys.modules, name, None)  # submodules already imported: cached, so blocked one by one
    monkeypatch.setitem(sys.modules, "openenv", None)  # `import openenv...` now raises ImportError
    monkeypatch.delitem(sys.modules, "grouprl.envs.openenv", raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install 'grouprl[openenv]'")) as info:
        importlib.import_module("grouprl.envs.openenv")
    assert str(info.value).startswith("grouprl.envs.openenv needs OpenEnv (the openenv-core package)")
    assert importlib.import_module("grouprl.envs").__name__ == "grouprl.envs"  # the package needs no adapter's library
