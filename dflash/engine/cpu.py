"""What arithmetic this CPU does natively, read once: the start-up log and every bench print it
next to their numbers (an AVX2 machine and an AMX machine rank kernels differently).
"""

from __future__ import annotations

import functools
from pathlib import Path


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
    except OSError:  # not Linux: torch's dispatch level (it cannot tell bf16 support)
        import torch  # here: reading the kind must not cost a server on a fake engine torch's import

        return torch.backends.cpu.get_cpu_capability()
    flag_lines = (line.split(":", 1)[1] for line in text.splitlines() if line.startswith("flags"))
    return kind_from_flags(frozenset(next(flag_lines, "").split()))
