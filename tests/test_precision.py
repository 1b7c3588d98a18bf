"""bf16: auto | true | false resolved for the device (grouprl/precision.py)."""

import pytest
import torch

import grouprl.precision as precision
from grouprl.config import ConfigError, TrainConfig
from grouprl.precision import native_bf16, resolve_bf16

CPU = torch.device("cpu")


@pytest.fixture
def cpu_flags(monkeypatch):
    """Pretend this CPU has exactly the given native-bf16 flags."""
    def set_flags(*flags):
        monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: tuple(flags))
    return set_flags


def test_auto_takes_bf16_exactly_where_the_cpu_has_it(cpu_flags):
    cpu_flags("avx512_bf16")
    assert resolve_bf16("auto", CPU) is True
    assert native_bf16(CPU) == (True, "this CPU has avx512_bf16")
    cpu_flags()
    assert resolve_bf16("auto", CPU) is False
    assert resolve_bf16(False, CPU) is False


def test_true_without_native_bf16_is_refused_with_the_fix(cpu_flags):
    cpu_flags()
    with pytest.raises(ConfigError, match=r"bf16=true: this CPU has neither of avx512_bf16, amx_bf16.*"
                                          r"set bf16: auto .* or bf16: false"):
        resolve_bf16(True, CPU)
    cpu_flags("amx_bf16")
    assert resolve_bf16(True, CPU) is True


def test_the_probe_agrees_with_proc_cpuinfo():
    flags = precision._proc_cpuinfo_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags line here")
    assert ("avx512_bf16" in precision.cpu_bf16_flags()) == ("avx512_bf16" in flags)


def test_config_accepts_auto_true_false_and_names_anything_else(tmp_path):
    base = dict(model="builtin:default_policy", train_data="builtin:arithmetic/train", output_dir=str(tmp_path),
                reward_funcs=["math_accuracy"])
    assert TrainConfig(**base).bf16 == "auto"
    for value in ("auto", True, False):
        TrainConfig(**base, bf16=value).validate()
    with pytest.raises(ConfigError, match=r"bf16='yes' is not one of: auto, true, false"):
        TrainConfig(**base, bf16="yes").validate()


def test_the_trainer_refuses_before_loading_any_model(cpu_flags, tmp_path, monkeypatch):
    from grouprl import trainer as trainer_module
    from grouprl.tasks import DEFAULT_TASK

    cpu_flags()
    loaded = []
    monkeypatch.setattr(trainer_module, "load_policy", lambda *a, **k: loaded.append(a))
    cfg = TrainConfig(**{**DEFAULT_TASK, "bf16": True, "output_dir": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="bf16=true"):
        trainer_module.Trainer(cfg)
    assert loaded == []
