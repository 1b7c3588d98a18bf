"""Which precision the policy's matmuls run in: `bf16: auto | true | false`.

bf16 here always means autocast: master weights, gradients and optimizer state stay fp32, and
log-probs are computed in fp32 from the (bf16) logits (core/logprobs.py). It pays only where the
hardware multiplies bf16 natively:

- a CUDA GPU that reports bf16 support (Ampere and later);
- an x86 CPU with AVX512-BF16 or AMX-BF16 instructions (`lscpu` flags avx512_bf16, amx_bf16).

Elsewhere bf16 is emulated. Square matmuls on one 2-core AVX512-BF16 CPU, with oneDNN held to
each instruction set by ONEDNN_MAX_CPU_ISA (benchmarks/README.md, "bf16 on CPUs"):

    oneDNN's instructions     fp32 GFLOP/s   bf16 GFLOP/s   bf16 / fp32
    all (AVX512-BF16)             214            959            4.5
    AVX-512, no bf16              210            168            0.8
    AVX2                          211              2.6          0.012   (80x slower)

So `auto` (the default) takes bf16 exactly where it is native and fp32 elsewhere, and `true` on
hardware without native bf16 is refused with the reason instead of running slower.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from grouprl.config import ConfigError

_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=None)
def cpu_bf16_flags() -> tuple[str, ...]:
    """The native-bf16 instruction sets of this CPU, by the names `lscpu` prints."""
    found = []
    probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported"}
    for flag, probe in probes.items():
        fn = getattr(torch.cpu, probe, None)
        if fn is not None:
            if fn():
                found.append(flag)
        elif flag in _proc_cpuinfo_flags():
            found.append(flag)
    return tuple(found)


def _proc_cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """(whether `device` multiplies bf16 natively, the reason in words)."""
    if device.type == "cuda":  # this device, natively: torch.cuda.is_bf16_supported() asks about the current
        # device, and by default also says True for a GPU that only emulates bf16 (a T4, a V100: before Ampere)
        name = torch.cuda.get_device_name(device)
        if torch.version.hip:
            return True, f"{name} supports bf16"
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            return True, f"{name} supports bf16"
        return False, (f"{name} (compute capability {major}.{minor}) does not support bf16 natively "
                       f"(from 8.0, Ampere, on)")
    if device.type == "cpu":
        flags = cpu_bf16_flags()
        if flags:
            return True, f"this CPU has {' and '.join(flags)}"
        return False, f"this CPU has neither of {', '.join(_CPU_FLAGS)} (torch would emulate bf16 matmuls)"
    return False, f"device type {device.type!r} is not one grouprl knows to multiply bf16 natively"


def resolve_bf16(setting: bool | str, device: torch.device) -> bool:
    """The `bf16` config value made definite for `device`: `auto` follows `native_bf16`, `True` on
    hardware without native bf16 is a ConfigError naming the hardware and the fix."""
    native, why = native_bf16(device)
    if setting == "auto":
        return native
    if setting is True and not native:
        raise ConfigError(f"bf16=true: {why}, so bf16 autocast would run slower than fp32 (measured 80x "
                          "slower on an AVX2-only CPU, 1.25x with AVX-512 but no bf16: grouprl/precision.py); "
                          "set bf16: auto (bf16 where native, fp32 elsewhere) or bf16: false")
    return bool(setting)


def describe_precision(setting: bool | str, device: torch.device) -> str:
    """The start line's words for what runs and why, e.g. "bf16 autocast (bf16=auto: NVIDIA H200
    supports bf16)" or "fp32 (bf16=false, set in the config)"."""
    if setting == "auto":
        native, why = native_bf16(device)
        return f"{'bf16 autocast' if native else 'fp32'} (bf16=auto: {why})"
    return f"{'bf16 autocast' if setting else 'fp32'} (bf16={str(bool(setting)).lower()}, set in the config)"
