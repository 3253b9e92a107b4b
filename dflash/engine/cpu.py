"""What arithmetic this CPU does natively, read once: kernel and dtype choices follow it, and every
bench prints it next to its numbers (an AVX2 machine and an AMX machine rank kernels differently).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Kinds that multiply bf16 in hardware (AVX512-BF16 dot products, AMX tiles); the others convert
# bf16 to fp32 lane by lane, so bf16 only saves memory there.
NATIVE_BF16_KINDS = frozenset({"AMX", "AVX512-BF16"})


def kind_from_flags(flags: frozenset[str]) -> str:
    """The strongest of AMX / AVX512-BF16 / AVX512 / AVX2 that a /proc/cpuinfo flag set names."""
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX512"
    if "avx2" in flags:
        return "AVX2"
    return "other"


@functools.cache
def cpu_kind() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: torch's dispatch level cannot tell bf16 support, so claim none
        return torch.backends.cpu.get_cpu_capability()
    flag_lines = (line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags"))
    return kind_from_flags(frozenset(next(flag_lines, "").split()))


def has_native_bf16(kind: str) -> bool:
    return kind in NATIVE_BF16_KINDS
