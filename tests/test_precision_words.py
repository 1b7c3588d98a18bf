"""The start line says what runs and why, without contradicting itself (issue 34: it read
"matmuls in fp32 (bf16=False: NVIDIA H200 supports bf16)")."""

import pytest
import torch

from grouprl import precision


@pytest.mark.parametrize("native, want", [
    (True, "bf16 autocast (bf16=auto: GPU X supports bf16)"),
    (False, "fp32 (bf16=auto: GPU X supports bf16)"),
])
def test_auto_says_what_the_hardware_decided(monkeypatch, native, want):
    monkeypatch.setattr(precision, "native_bf16", lambda device: (native, "GPU X supports bf16"))
    assert precision.describe_precision("auto", torch.device("cpu")) == want


@pytest.mark.parametrize("setting, want", [(False, "fp32 (bf16=false, set in the config)"),
                                           (True, "bf16 autocast (bf16=true, set in the config)")])
def test_an_explicit_setting_is_named_as_the_config_s(monkeypatch, setting, want):
    monkeypatch.setattr(precision, "native_bf16", lambda device: pytest.fail("an explicit setting asks no hardware"))
    assert precision.describe_precision(setting, torch.device("cpu")) == want


def test_the_words_match_what_resolve_bf16_runs():
    device = torch.device("cpu")
    runs_bf16 = precision.resolve_bf16("auto", device)
    assert precision.describe_precision("auto", device).startswith("bf16 autocast" if runs_bf16 else "fp32 (")
