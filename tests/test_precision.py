"""bf16: auto | true | false resolved for the device (grouprl/precision.py).

What each test expects is stated per device: the tests that pass CPU pin the CPU path (its flags
pretended); the trainer's tests pretend that whatever device the trainer picks (cuda:0 on a CUDA
machine, the CPU elsewhere) has or lacks native bf16; one test asks the real device and expects
what it answers (on a bf16 GPU, bf16=true is accepted)."""

import re

import pytest
import torch

import grouprl.precision as precision
from grouprl.config import ConfigError, TrainConfig
from grouprl.precision import native_bf16, resolve_bf16

CPU = torch.device("cpu")  # the tests that name it pin the CPU path; the trainer tests take the trainer's device


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


def trainer_device() -> torch.device:
    """The device a single-process Trainer trains on: cuda:0 on a CUDA machine, else the CPU
    (grouprl/distributed.py init_distributed)."""
    from grouprl.distributed import init_distributed

    return init_distributed().device


@pytest.fixture
def device_bf16(monkeypatch):
    """Pretend that whatever device is asked about (cuda:0 on a GPU machine, the CPU elsewhere) does,
    or does not, multiply bf16 natively; records the devices asked about."""
    asked = []

    def set_native(native: bool):
        def fake(device):
            asked.append(device)
            return native, f"pretend {device} {'supports' if native else 'does not support'} bf16"
        monkeypatch.setattr(precision, "native_bf16", fake)
        return asked
    return set_native


class Loaded(Exception):
    """Raised by the stand-in load_policy: the trainer got past the precision check."""


def _trainer_with(bf16, tmp_path, monkeypatch):
    from grouprl import trainer as trainer_module
    from grouprl.tasks import DEFAULT_TASK

    def load_policy(*args, **kwargs):
        raise Loaded
    monkeypatch.setattr(trainer_module, "load_policy", load_policy)
    cfg = TrainConfig(**{**DEFAULT_TASK, "bf16": bf16, "output_dir": str(tmp_path / "run")})
    return trainer_module.Trainer(cfg)


def test_the_trainer_refuses_before_loading_any_model(device_bf16, tmp_path, monkeypatch):
    """On any machine: the device the trainer picks is made to lack native bf16, so bf16=true is
    refused, before a model loads (a real bf16 GPU accepts it: the next test)."""
    asked = device_bf16(False)
    with pytest.raises(ConfigError, match="bf16=true: pretend .* does not support bf16"):
        _trainer_with(True, tmp_path, monkeypatch)
    assert asked and set(asked) == {trainer_device()}  # the check asked about the device the trainer trains on


def test_the_trainer_accepts_bf16_true_where_its_device_has_it(device_bf16, tmp_path, monkeypatch):
    asked = device_bf16(True)
    with pytest.raises(Loaded):  # past the precision check, on to loading the model
        _trainer_with(True, tmp_path, monkeypatch)
    assert asked and set(asked) == {trainer_device()}


def test_the_real_device_decides_auto_and_true():
    """No pretending: on this machine's trainer device (a GPU with bf16: accepted; a CPU without
    avx512_bf16/amx_bf16: refused), `auto` takes bf16 exactly where `true` is accepted."""
    device = trainer_device()
    native, why = native_bf16(device)
    assert resolve_bf16("auto", device) is native
    assert resolve_bf16(False, device) is False
    if native:
        assert resolve_bf16(True, device) is True
    else:
        with pytest.raises(ConfigError, match="bf16=true: " + re.escape(why)):
            resolve_bf16(True, device)


def test_a_cuda_device_is_asked_about_itself(monkeypatch):
    """The CUDA branch of native_bf16, on any machine (torch.cuda's answers pretended): the device asked
    about (not the current one), natively. torch.cuda.is_bf16_supported() says True for a T4 or a V100,
    which only emulate bf16, so it is not what decides."""
    cuda = torch.device("cuda", 1)
    capability = {1: (8, 0), 0: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU {torch.device(device).index}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[torch.device(device).index])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: pytest.fail("asks the current device"))
    monkeypatch.setattr(torch.version, "hip", None)
    assert native_bf16(cuda) == (True, "GPU 1 supports bf16")
    assert resolve_bf16("auto", cuda) is True and resolve_bf16(True, cuda) is True
    capability[1] = (7, 0)  # a V100
    assert native_bf16(cuda) == (False, "GPU 1 (compute capability 7.0) does not support bf16 natively "
                                        "(from 8.0, Ampere, on)")
    assert resolve_bf16("auto", cuda) is False
    with pytest.raises(ConfigError, match=r"bf16=true: GPU 1 \(compute capability 7.0\) does not support bf16"):
        resolve_bf16(True, cuda)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: bf16 on every architecture torch builds for
    assert native_bf16(cuda) == (True, "GPU 1 supports bf16")
