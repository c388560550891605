"""What the CPU at hand can do, read once from /proc/cpuinfo (Linux); the loader's dtype choice
and the GGUF path choice read it."""

from __future__ import annotations

import functools

from asyncengine.config import environment


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """Whether the CPU has bfloat16 dot products; ``ASYNCENGINE_CPU_BF16=0`` says no (``auto``
    then means float32 on any CPU, as the test suite runs)."""
    if environment.get("ASYNCENGINE_CPU_BF16") == "0":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
