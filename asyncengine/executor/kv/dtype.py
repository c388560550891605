"""``--kv-cache-dtype``: the KV cache's element type, as vLLM names it.

``auto`` keeps K and V in the model's dtype. ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store
them as one byte each, half a bfloat16 cache: twice the blocks in the same memory, and half
the bytes each decode step reads. The values are stored unscaled (vLLM's scale of 1.0 where a
checkpoint brings no calibrated ``k_scale`` / ``v_scale``), rounded to nearest even and
saturated at the type's largest finite value (448 for e4m3, 57344 for e5m2); attention reads
them back exactly. e4m3 keeps 3 mantissa bits (a relative error up to 1/16) over a range from
2^-9 to 448, e5m2 2 bits over 2^-16 to 57344. On the CPU the own kernels read and write the
float8 cache in place (``kernels/kv_fp8.h``); the PyTorch path (other dtypes, SDPA groups)
rounds on write and widens what it gathers.

The CUDA path (FlashInfer takes float8 pages) has not run on a GPU: there the flag is refused.
"""

from __future__ import annotations

import torch

#: --kv-cache-dtype's float8 values: vLLM's names.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}
#: The largest finite value of each float8 cache dtype: K and V saturate there.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_SAME = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def kv_cache_dtype(flag: str, dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The cache's torch dtype for ``--kv-cache-dtype flag``, a model in ``dtype`` on
    ``device_type``; ``ValueError`` naming the flag where it cannot be had."""
    if flag == "auto":
        return dtype
    if flag in _SAME:
        if _SAME[flag] != dtype:
            raise ValueError(f"--kv-cache-dtype {flag}: the model runs in "
                             f"{str(dtype).removeprefix('torch.')}; the cache is kept in "
                             "the model's dtype (auto) or in fp8, fp8_e4m3, fp8_e5m2")
        return dtype
    if flag not in FP8_DTYPES:
        raise ValueError(f"--kv-cache-dtype: invalid value {flag!r} (allowed: auto, "
                         f"{', '.join(_SAME)}, {', '.join(FP8_DTYPES)})")
    if device_type != "cpu":
        raise ValueError(f"--kv-cache-dtype {flag}: on the CPU only; the float8 cache's CUDA "
                         "path has not run on a GPU (use auto there)")
    return FP8_DTYPES[flag]


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as the cache stores them: float8 saturated, another dtype cast."""
    if x.dtype == cache_dtype:
        return x
    limit = FP8_MAX.get(cache_dtype)
    if limit is None:
        return x.to(cache_dtype)
    return x.float().clamp(-limit, limit).to(cache_dtype)


def index_copy(cache: torch.Tensor, dim: int, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache.index_copy_(dim, index, rows)`` where ``rows`` are already in the cache's dtype,
    float8 included (which ``index_copy_`` lacks on the CPU: its bytes are copied)."""
    if cache.dtype in FP8_MAX:
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(dim, index, rows)
