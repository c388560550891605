"""A stand-in for the ``flashinfer`` package on the CPU, for tests and ``asyncengine bench
host`` (the host-side proxy of a GPU: ``runtime/simulated_gpu.py``).

It implements the slice of FlashInfer's Python API the engine uses, with FlashInfer's
documented semantics and naive torch code: paged prefill/decode wrappers (``plan`` then
``run`` over an "NHD" ``(k_cache, v_cache)`` pair; causal masks aligned to the end of each
request's keys; fixed buffers in CUDA-graph mode, which ``run`` then reads), the segment
GEMM the LoRA path runs (``SegmentGEMMWrapper``), and the sampling
functions (deterministic: the argmax of what top-k would keep). It also checks the contract
the engine relies on to never synchronize with the device: indptr and last-page-length
arrays arrive on the host, as int32.

It proves the engine drives the API as documented; that the real kernels agree is for
``tests/gpu/test_gpu.py`` to show on a GPU.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _host_int32(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or t.dtype != torch.int32:
        raise AssertionError(f"{name} must be an int32 host tensor (got {t.dtype} on {t.device})")
    return t


class _PagedWrapper:
    """What the prefill and decode wrappers share."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 **_: Any) -> None:
        if kv_layout != "NHD":
            raise AssertionError(f"unexpected kv_layout {kv_layout}")
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            if paged_kv_indptr_buffer is None or paged_kv_last_page_len_buffer is None \
                    or paged_kv_indices_buffer is None:
                raise ValueError("cuda graph mode needs the fixed buffers")
            if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
                raise ValueError("indptr buffer must be batch_size + 1")
        self.indptr_buf = paged_kv_indptr_buffer
        self.indices_buf = paged_kv_indices_buffer
        self.last_buf = paged_kv_last_page_len_buffer
        self.num_plans = 0
        self.planned: dict[str, Any] | None = None

    def _plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
              last: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              page_size: int, causal: bool, sm_scale: float | None, window_left: int = -1,
              logits_soft_cap: float | None = None) -> None:
        _host_int32("paged_kv_indptr", indptr)
        _host_int32("paged_kv_last_page_len", last)
        if indices.dtype != torch.int32:
            raise AssertionError("paged_kv_indices must be int32")
        batch = len(last)
        if self.use_cuda_graph:
            if batch != len(self.last_buf):
                raise ValueError(f"batch {batch} != fixed batch {len(self.last_buf)}")
            if len(indices) > len(self.indices_buf):
                raise ValueError("indices overflow the fixed buffer")
            self.indptr_buf.copy_(indptr)
            self.last_buf.copy_(last)
            self.indices_buf[:len(indices)].copy_(indices)
        else:
            self.indptr_buf, self.indices_buf, self.last_buf = indptr, indices, last
        self.planned = dict(qo_indptr=qo_indptr, num_qo_heads=num_qo_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                            causal=causal, sm_scale=sm_scale or head_dim**-0.5,
                            window_left=window_left, logits_soft_cap=logits_soft_cap)
        self.num_plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        p = self.planned
        if p is None:
            raise RuntimeError("run() before plan()")
        k_cache, v_cache = paged_kv_cache
        if k_cache.dim() != 4 or k_cache.shape[1] != p["page_size"]:
            raise AssertionError(f"expected NHD pages of {p['page_size']}, got "
                                 f"{tuple(k_cache.shape)}")
        indptr = self.indptr_buf.tolist()
        last = self.last_buf.tolist()
        qo = p["qo_indptr"].tolist()
        group = p["num_qo_heads"] // p["num_kv_heads"]
        out = torch.zeros_like(q)
        for i in range(len(last)):
            pages = self.indices_buf[indptr[i]:indptr[i + 1]].long()
            length = (len(pages) - 1) * p["page_size"] + last[i]
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length].float()
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length].float()
            k = k.repeat_interleave(group, dim=1)  # [L, heads, dim]
            v = v.repeat_interleave(group, dim=1)
            rows = slice(qo[i], qo[i + 1])
            qi = q[rows].float()  # [Q, heads, dim]
            scores = torch.einsum("qhd,khd->hqk", qi, k) * p["sm_scale"]
            cap = p["logits_soft_cap"]
            if cap:  # FlashInfer's LogitsSoftCap: cap * tanh(score / cap), after sm_scale
                scores = cap * torch.tanh(scores / cap)
            n_q = qi.shape[0]
            key = torch.arange(length)[None, :]
            pos = (length - n_q + torch.arange(n_q))[:, None]  # each query's position
            if p["causal"]:
                scores = scores.masked_fill(key > pos, float("-inf"))
            if p["window_left"] >= 0:  # keys at positions >= pos - window_left
                scores = scores.masked_fill(key < pos - p["window_left"], float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=False,
             sm_scale=None, window_left=-1, logits_soft_cap=None, q_data_type=None,
             kv_data_type=None, **_: Any) -> None:
        _host_int32("qo_indptr", qo_indptr)
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                   window_left, logits_soft_cap)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, sm_scale=None, window_left=-1, logits_soft_cap=None, q_data_type=None,
             kv_data_type=None, **_: Any) -> None:
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale, window_left, logits_soft_cap)


class SegmentGEMMWrapper:
    """``flashinfer.SegmentGEMMWrapper`` (0.7): ``run`` computes ``y[seg] = x[seg] @ W``,
    ``W = weights[weight_indices[i]]`` read as ``(d_out, d_in)`` when ``weight_column_major``
    else ``(d_in, d_out)``, into a zeroed output (the CUTLASS kernel accumulates into it).
    It checks what the kernels need: one fp dtype for x and the weights (float32 allowed
    here, for float32 comparisons on the CPU), every dimension a multiple of 8, int64
    ``seg_indptr`` [batch_size + 1] and ``weight_indices`` [batch_size] on x's device (read
    by the device: the engine must never need them on the host). ``calls`` records
    ``(num_rows, batch_size, weight_column_major)``."""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        self.workspace = float_workspace_buffer
        self.calls: list[tuple[int, int, bool]] = []

    def run(self, x: torch.Tensor, weights: torch.Tensor, batch_size: int,
            weight_column_major: bool, out: torch.Tensor | None = None,
            seg_lens: torch.Tensor | None = None, seg_indptr: torch.Tensor | None = None,
            weight_indices: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or weights.dim() != 3 or x.dtype != weights.dtype:
            raise AssertionError(f"x {x.dtype} {tuple(x.shape)}, weights {weights.dtype} "
                                 f"{tuple(weights.shape)}")
        if not isinstance(batch_size, int):
            raise AssertionError("batch_size must be a host int")
        if any(d % 8 for d in (*weights.shape[1:], x.shape[1])):
            raise AssertionError(f"dimensions not multiples of 8: {tuple(weights.shape)}")
        if seg_indptr is None:
            raise AssertionError("the engine passes seg_indptr")
        for name, t, n in (("seg_indptr", seg_indptr, batch_size + 1),
                           ("weight_indices", weight_indices, batch_size)):
            if t is None or t.dtype != torch.int64 or t.device != x.device or t.shape != (n,):
                raise AssertionError(f"{name}: {None if t is None else (t.dtype, t.shape)}")
        d_in = weights.shape[2] if weight_column_major else weights.shape[1]
        d_out = weights.shape[1] if weight_column_major else weights.shape[2]
        if x.shape[1] != d_in or int(seg_indptr[-1]) != x.shape[0]:
            raise AssertionError("x does not match the weights or the segments")
        y = torch.zeros(x.shape[0], d_out, dtype=x.dtype, device=x.device) if out is None \
            else out
        for i in range(batch_size):
            lo, hi = int(seg_indptr[i]), int(seg_indptr[i + 1])
            w = weights[int(weight_indices[i])]
            y[lo:hi] += x[lo:hi] @ (w.T if weight_column_major else w)
        self.calls.append((x.shape[0], batch_size, weight_column_major))
        return y


def make_module() -> tuple[types.ModuleType, types.ModuleType]:
    """``(flashinfer, flashinfer.sampling)`` stand-ins; ``sampling.calls`` records calls."""
    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    fi.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fi.SegmentGEMMWrapper = SegmentGEMMWrapper
    sampling = types.ModuleType("flashinfer.sampling")
    sampling.calls = []

    def top_k_top_p_sampling_from_logits(logits, top_k, top_p, indices=None,
                                         filter_apply_order="top_k_first",
                                         deterministic=True, generator=None, check_nan=False):
        sampling.calls.append(("top_k_top_p", top_k, top_p, filter_apply_order))
        return logits.argmax(dim=-1).to(torch.int32)

    def sampling_from_logits(logits, indices=None, deterministic=True, generator=None,
                             check_nan=False):
        sampling.calls.append(("plain",))
        return logits.argmax(dim=-1).to(torch.int32)

    def top_p_sampling_from_probs(probs, top_p, indices=None, deterministic=True,
                                  generator=None, check_nan=False, **_: Any):
        sampling.calls.append(("top_p", top_p))
        return probs.argmax(dim=-1).to(torch.int32)

    def top_k_sampling_from_probs(probs, top_k, indices=None, deterministic=True,
                                  generator=None, check_nan=False, **_: Any):
        sampling.calls.append(("top_k", top_k))
        return probs.argmax(dim=-1).to(torch.int32)

    sampling.top_k_top_p_sampling_from_logits = top_k_top_p_sampling_from_logits
    sampling.top_p_sampling_from_probs = top_p_sampling_from_probs
    sampling.top_k_sampling_from_probs = top_k_sampling_from_probs
    sampling.sampling_from_logits = sampling_from_logits
    fi.sampling = sampling
    fi.norm, fi.activation, fi.rope = layer_op_modules()
    return fi, sampling


def layer_op_modules(calls: list | None = None) -> tuple[types.ModuleType, ...]:
    """``flashinfer.norm``, ``.activation`` and ``.rope`` stand-ins: FlashInfer's documented
    semantics in float32 with one rounding; ``calls`` records each call's name."""
    calls = [] if calls is None else calls
    norm, act, rope = (types.ModuleType(f"flashinfer.{n}") for n in ("norm", "activation", "rope"))

    def _rms(x, weight, eps, offset):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (x32 * (weight.float() + offset)).to(x.dtype)

    def _plain(name, offset):
        def fn(input, weight, eps=1e-6, out=None, enable_pdl=None):
            calls.append(name)
            result = _rms(input, weight, eps, offset)
            return result if out is None else out.copy_(result)
        return fn

    def _fused(name, offset):
        def fn(input, residual, weight, eps=1e-6, enable_pdl=None):
            calls.append(name)
            residual.copy_((input.float() + residual.float()).to(residual.dtype))
            input.copy_(_rms(residual, weight, eps, offset))
        return fn

    norm.rmsnorm, norm.gemma_rmsnorm = _plain("rmsnorm", 0.0), _plain("gemma_rmsnorm", 1.0)
    norm.fused_add_rmsnorm = _fused("fused_add_rmsnorm", 0.0)
    norm.gemma_fused_add_rmsnorm = _fused("gemma_fused_add_rmsnorm", 1.0)

    def _act_mul(name, fn):
        def run(input, out=None, enable_pdl=None):
            calls.append(name)
            gate, up = input.float().chunk(2, dim=-1)
            return (fn(gate) * up).to(input.dtype)
        return run

    act.silu_and_mul = _act_mul("silu_and_mul", torch.nn.functional.silu)
    act.gelu_tanh_and_mul = _act_mul(
        "gelu_tanh_and_mul", lambda g: torch.nn.functional.gelu(g, approximate="tanh"))

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                              is_neox=True):
        calls.append("rope")
        if not is_neox or cos_sin_cache.dtype != torch.float32:
            raise AssertionError("expected neox halves and a float32 table")
        half = cos_sin_cache.shape[-1] // 2
        cos, sin = cos_sin_cache[positions].split(half, dim=-1)  # [T, half] each
        cos, sin = cos[:, None], sin[:, None]
        for t in (query, key):
            x = t.view(t.shape[0], -1, head_size)  # a view: strided rows allowed
            x32 = x[..., :2 * half].float()
            x1, x2 = x32[..., :half], x32[..., half:]
            x[..., :2 * half] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(
                x.dtype)

    rope.apply_rope_with_cos_sin_cache_inplace = apply_rope_with_cos_sin_cache_inplace
    for m in (norm, act, rope):
        m.calls = calls
    return norm, act, rope
