"""glibc's malloc, tuned for a step loop that allocates the same large tensors every step.

A decode step allocates and frees buffers of a few to tens of MB each time: the logits of a
batch (32 rows x a 151936 vocabulary: 19 MB in float32, then its bfloat16 copy), activations
of a prefill chunk. glibc serves a block past its mmap threshold (128 KB, raised as blocks are
freed, up to 32 MB) with mmap and returns it with munmap, and trims the top of a heap past the
trim threshold with madvise: the next step faults every page back in, zeroed by the kernel. On
the Zen 5 of docs/benchmarks.md that was 12% of a 32-row decode step of a Qwen2.5-0.5B-shaped
GGUF file in the kernel (page faults, madvise, munmap), against 0.3% with the thresholds below.

So on the CPU, once at start-up: blocks up to 32 MB (glibc's largest mmap threshold) come from
the heap, and up to 256 MB freed at a heap's top stay there for the next step. The resident
set keeps the high-water mark of those blocks instead of giving it back between steps.
Elsewhere (musl, macOS, Windows) this does nothing. ``GLIBC_TUNABLES`` set by the user wins:
then nothing is changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import platform
import threading
from collections.abc import Iterator

from asyncengine.config import environment

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

_DONE: list[bool] = []


def keep_step_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds (once per process); whether they were set."""
    if _DONE:
        return _DONE[0]
    ok = False
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" \
            and not environment.is_set("GLIBC_TUNABLES"):
        try:
            libc = ctypes.CDLL(None)
            ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
                and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):
            ok = False
        if ok:
            logger.debug("glibc malloc: mmap threshold %d MB, trim threshold %d MB",
                         MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    _DONE.append(ok)
    return ok


M_ARENA_MAX = -8
#: The arenas of a router (``limit_arenas``).
ROUTER_ARENAS = 2


def limit_arenas(n: int = ROUTER_ARENAS) -> bool:
    """At most ``n`` glibc arenas from now on; whether it was set (glibc only, and not when
    the user set ``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES``).

    glibc gives threads their own arenas, up to 8 per core, and an arena's heap never shrinks
    below what its live blocks pin. A router loads each model in new threads (the loading
    thread, the start-up thread, the engine's worker), so with every load and unload more
    arenas kept a little more: the resident set after 20 load/unload cycles of the embedded
    model under load crept to +5.2% of its first unloaded value, +1.1% with two arenas
    (docs/benchmarks.md). Call it before the first load."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or \
            environment.is_set("GLIBC_TUNABLES") or environment.is_set("MALLOC_ARENA_MAX"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_ARENA_MAX, n))
    except (OSError, AttributeError):
        return False


# While a GGUF file loads, blocks from this size on are mapped and unmapped by glibc's malloc
# (not kept in its heap): a dequantized tensor and its temporaries, a few MB each, freed a
# layer later. Under the step loop's thresholds (up to 32 MB from the heap, never trimmed
# below 256 MB) the heap kept growing around the packed layers made in between: loading the
# embedded Q4_1 file as int4 layers (94 MB of them) left the resident set 344 MB above where
# it began, peaking at 405 MB; with this, and the heap trimmed after, 100 MB, peaking at
# 205 MB.
LOAD_MMAP_THRESHOLD = 256 << 10

_loads = [0]  # loads running now (a router loads several models at once, in threads)
_loads_lock = threading.Lock()


@contextlib.contextmanager
def freed_blocks_returned(on: bool) -> Iterator[None]:
    """For a load on the CPU (``on``), where the step loop's thresholds apply
    (``keep_step_buffers``; never against the user's ``GLIBC_TUNABLES``): large blocks mapped
    while it runs, then the step loop's thresholds back and the heap's free pages returned to
    the system. The thresholds are the process's: while any load runs (the first one sets
    them, the last one restores them) the other engines' large step buffers are mapped too,
    a few page faults a step for the length of the load."""
    if not (on and keep_step_buffers()):
        yield
        return
    libc = ctypes.CDLL(None)
    with _loads_lock:
        _loads[0] += 1
        if _loads[0] == 1:
            libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _loads_lock:
            _loads[0] -= 1
            if _loads[0] == 0:
                libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.malloc_trim(0)
