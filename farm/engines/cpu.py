"""The host's CPU as ``/proc/cpuinfo`` describes it: its name, and the flags that decide
which precisions run fast on it (read once per process)."""

from __future__ import annotations

import functools
import platform

#: Flags of int8 dot-product instructions; without one, int8 runs no faster than f32
#: (ONNX Runtime's own figures: onnxruntime#17389).
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: Flags that decide which precisions a CPU computes fast, as lscpu names them.
PRECISION_FLAGS = ("avx512_bf16", "amx_bf16", "amx_fp16", *INT8_FLAGS)


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's fields (``model name``, ``cpu family``, ``flags``...); empty
    where /proc/cpuinfo cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    return set(cpu_info().get("flags", "").split())


def precision_flags() -> list[str]:
    """The ``PRECISION_FLAGS`` this CPU has."""
    flags = cpu_flags()
    return [flag for flag in PRECISION_FLAGS if flag in flags]


def fast_int8() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI or AMX)."""
    return any(flag in cpu_flags() for flag in INT8_FLAGS)
