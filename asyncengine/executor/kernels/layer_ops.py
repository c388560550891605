"""The decoder layer's small ops on the CPU, one C++ call each.

Eager PyTorch pays ~5-10 us of dispatch and allocation per op, and a parallel op forks an
OpenMP team; at one decode token a Llama layer is ~60 such ops around its 7 matmuls, which
makes those costs most of a batch-1 step. Here each of these becomes one call of an own
kernel (``<name>.cpp``, float32 and bfloat16):

- ``rms_norm``: the residual add and the RMSNorm after it, Gemma's ``1 + w`` scale, per-head
  q / k norms (``rms_norm.cpp``);
- ``rope_``: RoPE on q and k, in place in the fused qkv output, whole heads or their first
  rotary dims (``rope.cpp``);
- ``act_mul``: SiLU(gate) * up, or GELU-tanh's, from the fused gate_up output
  (``silu_mul.cpp``);
- ``kv_write``: the step's K/V rows into their paged-cache slots (``kv_write.cpp``);
- ``decode_attention``: one query token per request against the paged cache read in place,
  split across threads by (request, KV head, span of positions) and merged exactly
  (``decode_attention.cpp``).

The last two are built again for a KV cache in float8 (``--kv-cache-dtype fp8``,
``kv_fp8.h``): ``kv_write`` rounds the rows to float8 as torch's cast does (saturated), and
attention widens the cached float8 exactly to float32.

Each op computes what its PyTorch counterpart computes, in float32 with one rounding to the
element type, so results agree to float32 rounding (``tests/executor/test_layer_ops.py``). The model
takes these paths only in eager mode on the CPU (``usable``); under ``torch.compile``
inductor generates its own fused kernels from the PyTorch path. ``ASYNCENGINE_CPU_KERNELS=0``
turns them off (the PyTorch path runs: for comparisons).
"""

from __future__ import annotations

import torch

from asyncengine.config import environment
from asyncengine.executor.kernels.build import DTYPE_CODES, KV_CODES, load

ENV = "ASYNCENGINE_CPU_KERNELS"
ENABLED = environment.on(ENV)

_ARGS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("const ae_t*", "ae_t*", "const ae_t*", "ae_t*", "int64_t", "int64_t",
                 "int64_t", "int64_t", "float", "int64_t", "float"),
    "rope": ("ae_t*", "const ae_t*", "const ae_t*", "int64_t", "int64_t", "int64_t", "int64_t",
             "int64_t"),
    "silu_mul": ("const ae_t*", "ae_t*", "int64_t", "int64_t", "int64_t"),
    "kv_write": ("const ae_t*", "const ae_t*", "ae_kv_t*", "const int64_t*", "int64_t", "int64_t",
                 "int64_t", "int64_t", "int64_t"),
    "decode_attention": ("const ae_t*", "const ae_kv_t*", "const int64_t*", "const int64_t*",
                         "const int64_t*", "ae_t*", "int64_t", "int64_t", "int64_t", "int64_t",
                         "int64_t", "int64_t", "int64_t", "int64_t", "float", "int64_t",
                         "int64_t", "float"),
}

# dtype -> {name: kernel}, for the dtypes whose kernels all built.
_BUILT: dict[torch.dtype, dict[str, object] | None] = {}


def _kernels(dtype: torch.dtype) -> dict[str, object] | None:
    if dtype not in _BUILT:
        code = DTYPE_CODES.get(dtype)
        fns = None if code is None else {n: load(n, a, code) for n, a in _ARGS.items()}
        _BUILT[dtype] = fns if fns is not None and all(fns.values()) else None
    return _BUILT[dtype]


# The kernels that read or write the KV cache: built again for each float8 cache dtype.
_KV_OPS = ("kv_write", "decode_attention")
_KV_BUILT: dict[tuple[torch.dtype, torch.dtype], dict[str, object] | None] = {}


def _kv_kernels(dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, object] | None:
    """``kv_write`` and ``decode_attention`` for activations of ``dtype`` and a KV cache of
    ``kv_dtype`` (the activations' own, or a float8 of ``KV_CODES``)."""
    if kv_dtype == dtype:
        return _kernels(dtype)
    key = (dtype, kv_dtype)
    if key not in _KV_BUILT:
        code, kv = DTYPE_CODES.get(dtype), KV_CODES.get(kv_dtype)
        fns = None
        if code is not None and kv is not None and _kernels(dtype) is not None:
            fns = {n: load(n, _ARGS[n], code, kv_code=kv) for n in _KV_OPS}
        _KV_BUILT[key] = fns if fns is not None and all(fns.values()) else None
    return _KV_BUILT[key]


def usable_kv(x: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    """``usable(x)``, and ``kv_write`` / ``decode_attention`` run for a cache of ``kv_dtype``."""
    return usable(x) and _kv_kernels(x.dtype, kv_dtype) is not None


def available(dtype: torch.dtype = torch.float32) -> bool:
    """On, and every op built for activations of ``dtype`` (a compiler is there)."""
    return ENABLED and _kernels(dtype) is not None


def usable(x: torch.Tensor) -> bool:
    """Whether the ops run for activations like ``x``: CPU, float32 or bfloat16, eager, on."""
    if not ENABLED or x.is_cuda or torch.compiler.is_compiling():
        return False
    built = _BUILT.get(x.dtype, False)
    if built is False:
        built = _kernels(x.dtype)
    return built is not None and x.device.type == "cpu"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, offset: float = 0.0
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, N] (rows may be strided) -> ``weight * norm(x)``, or with ``offset``
    ``norm(x) * (offset + weight)`` (Gemma's, in float32, rounded once). With ``residual``
    ([T, N], contiguous): it becomes ``x + residual`` in place, and the result is
    ``(weight * norm(x + residual), residual)``. ``x`` may be [T, heads, N] (heads
    contiguous, no residual): each head normed, a per-head q / k norm; the result contiguous."""
    heads = x.shape[1] if x.dim() == 3 else 1
    T, N = x.shape[0], x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    _kernels(x.dtype)["rms_norm"](x, out if residual is None else residual, weight, out, T, N,
                                  x.stride(0), int(residual is not None), float(eps), heads,
                                  float(offset))
    return out if residual is None else (out, residual)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on ``x`` [T, heads, D] (heads contiguous, rows may be strided); cos, sin
    from ``RotaryEmbedding`` ([T, 1, 2, R / 2], contiguous): the first R of each head turn
    (R = D, or fewer: partial rotary). Returns ``x``."""
    T, heads, D = x.shape
    _kernels(x.dtype)["rope"](x, cos, sin, T, heads, D, x.stride(0), 2 * cos.shape[-1])
    return x


#: ``act_mul``'s activations, by the name ``ModelSpec.activation`` gives.
ACTIVATIONS = ("silu", "gelu_tanh")


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``gate_up`` [T, 2 I] (contiguous) -> ``act(gate) * up`` [T, I], ``act`` SiLU or
    GELU's tanh form (``ACTIVATIONS``)."""
    T, two_i = gate_up.shape
    out = torch.empty(T, two_i // 2, dtype=gate_up.dtype)
    _kernels(gate_up.dtype)["silu_mul"](gate_up, out, T, two_i // 2,
                                        ACTIVATIONS.index(activation))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up`` [T, 2 I] (contiguous) -> ``silu(gate) * up`` [T, I]."""
    return act_mul(gate_up, "silu")


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Rows of ``k``, ``v`` ([T, kv_heads, D], heads contiguous) into slots ``slots`` (int64
    [T]) of ``kv_cache`` [2, blocks, block_size, kv_heads, D] (of their dtype, or a float8:
    ``usable_kv``)."""
    T, kv_heads, D = k.shape
    _kv_kernels(k.dtype, kv_cache.dtype)["kv_write"](
        k, v, kv_cache, slots, T, kv_heads * D, k.stride(0), v.stride(0), kv_cache.stride(0))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, rows: torch.Tensor, split: int,
                     scale: float, window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Attention of one query token per request over the paged cache, read in place.

    q: [T, heads, D] (a step's queries; heads contiguous); kv_cache: [2, blocks, block_size,
    kv_heads, D] (of q's dtype or a float8: ``usable_kv``); tables: int64 [B, n] block tables
    (contiguous); lens: int64 [B] keys per request (its new token's included, already
    written); rows: int64 [B], the row of ``q`` of each request; split: positions per work
    item (a multiple of block_size); window: only each request's last ``window`` keys;
    soft_cap: scores capped by ``cap * tanh(s / cap)``.
    Returns [B, heads, D]."""
    _, heads, D = q.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    B = rows.shape[0]
    out = torch.empty(B, heads, D, dtype=q.dtype)
    _kv_kernels(q.dtype, kv_cache.dtype)["decode_attention"](
        q, kv_cache, tables, lens, rows, out, B, heads, kv_heads, D, block_size,
        tables.stride(0), q.stride(0), split, float(scale), kv_cache.stride(0), window or 0,
        float(soft_cap or 0.0))
    return out


def decode_split(lens: list[int], kv_heads: int, block_size: int, threads: int) -> int:
    """The decode-attention kernel's ``split`` argument: a per-request rule (a negative code,
    ``decode_attention.cpp: ae_split_of``). Each request's positions are cut into spans of at
    least ``MIN_SPLIT``, two (request, KV head) spans per thread (the whole request where its
    KV heads alone keep the threads busy): the spans depend on the request's own length
    only, never on the batch, so its attention is computed the same whatever shares its step
    (a verification's draft rows, a larger batch). ``lens``, ``block_size``: unused by the
    rule (the kernel applies it per request); kept for callers that pass a batch.

    (Measured, 2 threads, 9 heads of 64 over 3 KV heads, bfloat16, per layer, against the
    batch-dependent rule before it, which split only where the batch's pairs were few: one
    request of 250 / 500 / 3,000 positions 0.90x / 0.96x / 1.05x the time; 9 rows of 500,
    a verification, 1.05x; 32 requests of 600 1.04x.)"""
    del lens, block_size
    return -((2 * threads) << 20 | MIN_SPLIT)


def split_of(split: int, length: int, kv_heads: int, block_size: int) -> int:
    """Positions per work item of a request of ``length`` keys under ``split`` (the kernel's
    ``ae_split_of``, for tests and sizing)."""
    if split > 0:
        return split
    code = -split
    min_split, divisor = code & 0xFFFFF, code >> 20
    s = length if kv_heads >= divisor else max(min_split, -(-length * kv_heads // divisor))
    s = max(1, min(s, length))
    return -(-s // block_size) * block_size


# Spans shorter than this cost more to merge than they gain in balance (< 2**20).
MIN_SPLIT = 256
