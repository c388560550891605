"""Building the C++ kernels, at first use, with inductor's C++ toolchain.

The sources are data, not Python: they live in the repository's top-level ``kernels/``
folder, and a wheel carries them as ``asyncengine/_kernels/`` (``setup.py`` copies them in).
:func:`kernel_dir` finds them either way. Each ``<name>.cpp`` defines one
``extern "C" void kernel(...)``; ``load`` inlines the files of that folder it includes,
``common.h`` at least (the headers of the CPU's features, float conversions, the vector exp,
threads), optionally fixes the element type (``AE_DTYPE``), and compiles it through
``CppPythonBindingsCodeCache``, the code cache ``--compile`` already uses: the compiler flags
are inductor's for this CPU (AVX2 / AVX-512 where present), the build takes a few seconds
once, and the shared object is cached on disk across restarts. The returned function takes
tensors for pointer arguments (their data pointers, no checks) and Python ints / floats for
the rest.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[2]  # .../asyncengine


def kernel_dir() -> Path:
    """The folder of the C++ sources: ``asyncengine/_kernels`` in an installed wheel, else
    the ``kernels/`` beside the package in a checkout (an editable install)."""
    for candidate in (_PACKAGE / "_kernels", _PACKAGE.parent / "kernels"):
        if (candidate / "common.h").is_file():
            return candidate
    raise FileNotFoundError(f"the C++ kernel sources are neither in {_PACKAGE / '_kernels'} "
                            f"nor in {_PACKAGE.parent / 'kernels'}")


_DIR = kernel_dir()

# AE_DTYPE codes of the element types the layer kernels are built for.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# AE_KV_FP8 codes of a KV cache in float8 (``kv_fp8.h``); a cache in the activations' dtype
# is code 0.
KV_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)


def _inline(name: str, seen: set[str], directory: Path = _DIR) -> str:
    """The text of ``name`` with its ``#include "..."`` of ``directory`` inlined, each file
    once (a file included again, like ``common.h`` by every kernel, is left out)."""

    def include(match: re.Match[str]) -> str:
        inc = match.group(1)
        if inc in seen:
            return ""
        seen.add(inc)
        return _inline(inc, seen, directory)

    return _LOCAL_INCLUDE.sub(include, (directory / name).read_text())


def source(name: str, dtype_code: int | None = None, directory: Path = _DIR,
           kv_code: int = 0) -> str:
    """The self-contained C++ source of kernel ``name``: ``<name>.cpp`` with the files it
    includes from that folder inlined (a kernel may include another one's ``.cpp`` under a
    renamed ``kernel``: ``decode_stack.cpp`` does). ``kv_code``: the KV cache's float8 type
    (``KV_CODES``; 0, the activations' dtype)."""
    text = _inline(f"{name}.cpp", {f"{name}.cpp"}, directory)
    if kv_code:
        text = f"#define AE_KV_FP8 {kv_code}\n{text}"
    if dtype_code is not None:
        text = f"#define AE_DTYPE {dtype_code}\n{text}"
    return text


@functools.cache
def load(name: str, argtypes: tuple[str, ...], dtype_code: int | None = None,
         directory: Path = _DIR, kv_code: int = 0) -> Callable[..., None] | None:
    """The compiled kernel ``name`` (for ``dtype_code``), or None where it cannot be built
    here (no compiler, an unsupported platform); callers then take their PyTorch path.
    ``directory``: where ``<name>.cpp`` is, when it is not one of ``kernel_dir()``;
    ``kv_code``: see :func:`source`."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(list(argtypes),
                                                         source(name, dtype_code, directory,
                                                                kv_code))
    except Exception as exc:
        logger.warning("the %s CPU kernel could not be built (%s: %s); its PyTorch path runs "
                       "instead", name, type(exc).__name__, exc)
        return None
