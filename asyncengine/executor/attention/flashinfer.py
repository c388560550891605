"""flashinfer: paged attention with FlashInfer's kernels (CUDA; bfloat16 or float16).

The KV cache is the block manager's: ``kv_cache[layer]`` is ``[2, num_blocks, block_size,
kv_heads, head_dim]`` and FlashInfer reads ``(kv_cache[0], kv_cache[1])``, two "NHD" page
tensors, as views (no copy); a KV block is a page. New K/V are written at the runner's
``slot_mapping`` exactly as ``torch_paged`` writes them; FlashInfer only reads the cache.

Per step:

* ``prepare`` (event loop, numpy only): the step's ``qo_indptr``, ``kv_indptr``,
  ``kv_indices``, ``kv_last_page_len`` from the persistent batch's block tables and lengths
  (``paged_plan.py``), padded with scratch-page rows when the step replays a CUDA graph.
* ``plan`` (device side, in step order): ONE ``wrapper.plan`` for the whole step, shared by
  every layer: the decode wrapper when every request has one query token, the prefill wrapper
  otherwise (prefill, chunked prefill, prefix hits, and mixed batches, whose decode rows are
  1-token queries to it), or the fixed-buffer decode wrapper of the step's CUDA graph.
* ``forward`` (per layer): write K/V, then ``wrapper.run(q, (k_cache, v_cache))``.

A wrapper's ``plan`` copies its schedule to the device from a pinned host buffer of its own,
asynchronously; planning the same wrapper again before that copy has run would overwrite the
buffer under it. With step N+1 planned while step N runs, the previous plan of a wrapper was
enqueued at least a whole step earlier, so its copy has long run; an event recorded after
each plan makes sure (``plan_waits`` counts the times the host had to wait: expected 0).

Padding rows of a CUDA graph (batch buckets) attend a scratch page: one KV block allocated
past the block manager's ``num_blocks`` that no request owns; their K/V are written there.

Layer variants (``AttentionOptions``: Gemma 2/3's soft cap, sliding windows of Gemma, Mistral,
Qwen2) are plan-time parameters of FlashInfer (``logits_soft_cap``, ``window_left = window -
1``), and each compiles its own kernel: the backend keeps one set of wrappers per distinct
variant of the model's layers (``configure_layers``) and plans each once per step. A layer
whose scale is not ``head_dim**-0.5`` (Gemma's ``query_pre_attn_scalar``) has its queries
multiplied by the ratio before the kernel.

JIT: FlashInfer compiles a kernel the first time a wrapper of a new (dtype, head_dim,
variant) is planned and run; :meth:`FlashInferBackend.prewarm` does that at start-up for every
kernel the engine will use, on a tiny scratch cache, so that nothing compiles while serving.
The prefill wrappers use FlashInfer's FA2 kernels (``PREFILL_BACKEND``): they exist for every
GPU since Ampere and every variant here, and compile faster than the Hopper (FA3) ones.

Never run on a GPU yet: CPU tests drive it with a stand-in for the flashinfer module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncengine.executor.attention.base import (
    PLAIN,
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)
from asyncengine.executor.attention.paged_plan import PagedKVPlan, pad_decode_plan, plan_paged_kv
from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.runtime.staging import pinned

#: FlashInfer's recommended workspace (split-k partial results), shared by every wrapper:
#: they run one after another on one stream.
WORKSPACE_BYTES = 256 << 20
#: FlashInfer's prefill kernel family (see the module's docstring).
PREFILL_BACKEND = "fa2"


@dataclass
class _StepPlan:
    plan: PagedKVPlan
    wrappers: dict[AttentionOptions, Any] | None = None  # set by ``plan``: one per variant


def variant_params(options: AttentionOptions) -> dict[str, Any]:
    """FlashInfer's plan-time parameters of a layer variant."""
    return dict(window_left=-1 if options.window is None else options.window - 1,
                logits_soft_cap=options.soft_cap)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    needs_block_tables_tensor = False
    supports_cuda_graphs = True
    extra_kv_blocks = 1  # the scratch page of CUDA-graph padding rows

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, *, max_pages_per_seq: int,
                 module: Any = None, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.fi = module if module is not None else importlib.import_module("flashinfer")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.sm_scale = head_dim**-0.5  # what every model here scales by
        self.max_pages_per_seq = max_pages_per_seq
        self._cuda = not on_host(self.device)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off for large GQA groups (FlashInfer's advice, as vLLM applies it).
        self._tensor_cores = num_heads // num_kv_heads > 4
        self.variants: tuple[AttentionOptions, ...] = (PLAIN,)
        self._prefill: dict[AttentionOptions, Any] = {}
        self._decode: dict[AttentionOptions, Any] = {}
        self._graph_wrappers: dict[tuple[int, AttentionOptions], Any] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._planned: dict[int, Any] = {}  # id(wrapper) -> event after its last plan
        self.plan_waits = 0
        self.scratch_block: int | None = None

    @property
    def prefill(self) -> Any:
        """The prefill wrapper of plain layers (of the first variant)."""
        return self.prefill_wrapper(self.variants[0])

    @property
    def decode(self) -> Any:
        return self.decode_wrapper(self.variants[0])

    def prefill_wrapper(self, options: AttentionOptions) -> Any:
        wrapper = self._prefill.get(options)
        if wrapper is None:
            wrapper = self._prefill[options] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=PREFILL_BACKEND)
        return wrapper

    def decode_wrapper(self, options: AttentionOptions) -> Any:
        wrapper = self._decode.get(options)
        if wrapper is None:
            wrapper = self._decode[options] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self._tensor_cores)
        return wrapper

    def configure_layers(self, options: list[AttentionOptions]) -> None:
        """The distinct variants of the model's layers, planned separately every step."""
        if self._graph_wrappers:
            raise ValueError("flashinfer backend: configure the layers before capturing graphs")
        self.variants = tuple(dict.fromkeys(options)) or (PLAIN,)

    # -- the cache ---------------------------------------------------------------------------
    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device | str) -> list[torch.Tensor]:
        """``num_blocks`` for the block manager plus one scratch page, the last."""
        return super().allocate_kv_cache(num_layers, num_blocks + 1, block_size,
                                         num_kv_heads, head_dim, dtype, device)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """The engine's cache: its last block is the scratch page of graph padding rows."""
        self.scratch_block = kv_caches[0].shape[1] - 1

    # -- per step ----------------------------------------------------------------------------
    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.block_tables_host is None:
            raise ValueError("the flashinfer backend plans from metadata.block_tables_host")
        plan = plan_paged_kv(metadata.block_tables_host, metadata.seq_lens,
                             metadata.query_start_loc, metadata.block_size)
        if metadata.padded_batch is not None:
            plan = pad_decode_plan(plan, metadata.padded_batch, self._scratch())
        metadata.extra = _StepPlan(plan)

    def plan(self, metadata: AttentionMetadata) -> None:
        step = metadata.extra
        if not isinstance(step, _StepPlan):
            self.prepare(metadata)
            step = metadata.extra
        if step.wrappers is not None:
            return
        p = step.plan
        indptr = pinned(p.kv_indptr, self._cuda)
        last = pinned(p.kv_last_page_len, self._cuda)
        indices = pinned(p.kv_indices, self._cuda).to(self.device, non_blocking=True)
        qo_indptr = None if p.decode_only else pinned(p.qo_indptr, self._cuda)
        wrappers: dict[AttentionOptions, Any] = {}
        for options in self.variants:
            if metadata.padded_batch is not None:
                wrapper = self.graph_wrapper(metadata.padded_batch, options)
            elif p.decode_only:
                wrapper = self.decode_wrapper(options)
            else:
                wrapper = self.prefill_wrapper(options)
            self._plan_one(wrapper, qo_indptr, indptr, indices, last, options)
            wrappers[options] = wrapper
        step.wrappers = wrappers

    def _plan_one(self, wrapper: Any, qo_indptr: torch.Tensor | None, indptr: torch.Tensor,
                  indices: torch.Tensor, last: torch.Tensor, options: AttentionOptions) -> None:
        self._wait_for_last_plan(wrapper)
        common = dict(sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype,
                      **variant_params(options))
        if qo_indptr is not None:
            wrapper.plan(qo_indptr, indptr, indices, last, self.num_heads, self.num_kv_heads,
                         self.head_dim, self.block_size, causal=True, **common)
        else:
            wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads,
                         self.head_dim, self.block_size, **common)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._planned[id(wrapper)] = event

    def _wait_for_last_plan(self, wrapper: Any) -> None:
        event = self._planned.get(id(wrapper))
        if event is not None and not event.query():
            self.plan_waits += 1
            event.synchronize()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float,
                options: AttentionOptions = PLAIN) -> torch.Tensor:
        step = metadata.extra
        if not isinstance(step, _StepPlan) or step.wrappers is None:
            self.plan(metadata)
            step = metadata.extra
        wrapper = step.wrappers.get(options)
        if wrapper is None:
            raise ValueError(f"flashinfer backend: layer variant {options} was not configured "
                             "(configure_layers)")
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_pages, page_size, kv_heads, dim]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        if scale != self.sm_scale:  # Gemma's query_pre_attn_scalar: planned at head_dim**-0.5
            q = q * (scale / self.sm_scale)
        return wrapper.run(q.contiguous(), (k_cache, v_cache))

    # -- JIT ---------------------------------------------------------------------------------
    def prewarm(self, graphs: bool = True) -> float:
        """Compile (FlashInfer's JIT, minutes the first time on a machine; cached on disk after)
        and load every kernel this backend will run: prefill and decode of each layer variant
        (and decode in CUDA-graph mode), on a scratch cache of two pages. At start-up, before
        serving: never on the loop at the first step. Returns the seconds it took."""
        import time

        start = time.perf_counter()
        pages = torch.zeros(2, 2, self.block_size, self.num_kv_heads, self.head_dim,
                            dtype=self.dtype, device=self.device)
        kv = (pages[0], pages[1])
        q = torch.zeros(2, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        one = np.array([0, 1], dtype=np.int32)
        indptr = pinned(one, self._cuda)
        indices = pinned(np.array([0], dtype=np.int32), self._cuda).to(self.device)
        last2 = pinned(np.array([2], dtype=np.int32), self._cuda)
        qo2 = pinned(np.array([0, 2], dtype=np.int32), self._cuda)
        decode_kinds = [self.decode_wrapper]
        if graphs:
            decode_kinds.append(self._prewarm_graph_wrapper)
        for options in self.variants:
            prefill = self.prefill_wrapper(options)
            self._plan_one(prefill, qo2, indptr, indices, last2, options)
            prefill.run(q, kv)
            for make in decode_kinds:
                wrapper = make(options)
                self._plan_one(wrapper, None, indptr, indices, last2, options)
                wrapper.run(q[:1], kv)
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._planned.clear()  # all complete; the throwaway wrappers' ids may be reused
        return time.perf_counter() - start

    def _prewarm_graph_wrapper(self, options: AttentionOptions) -> Any:
        """A throwaway CUDA-graph-mode decode wrapper of one row (own fixed buffers)."""
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(2, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(1, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(1, dtype=torch.int32, device=self.device))

    # -- CUDA graphs -------------------------------------------------------------------------
    def graph_wrapper(self, batch: int, options: AttentionOptions | None = None) -> Any:
        """The decode wrapper with fixed buffers for CUDA graphs of ``batch`` rows (of the layer
        variant ``options``; the first by default). The buffers are shared by all batch sizes
        and variants (graphs replay one at a time on one stream; every variant plans the same
        pages)."""
        key = (batch, self.variants[0] if options is None else options)
        wrapper = self._graph_wrappers.get(key)
        if wrapper is None:
            indptr, indices, last = self._shared_graph_buffers(batch)
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=indptr[:batch + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:batch])
            self._graph_wrappers[key] = wrapper
        return wrapper

    def _shared_graph_buffers(self, batch: int) -> tuple[torch.Tensor, ...]:
        if self._graph_buffers is None or self._graph_buffers[2].numel() < batch:
            if self._graph_wrappers:
                raise ValueError("capture the largest CUDA graph batch first")
            self._graph_buffers = (
                torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
                torch.zeros(batch * self.max_pages_per_seq, dtype=torch.int32,
                            device=self.device),
                torch.zeros(batch, dtype=torch.int32, device=self.device))
        return self._graph_buffers

    def graph_capture_metadata(self, batch: int, slot_mapping: torch.Tensor
                               ) -> AttentionMetadata:
        """Metadata for capturing a decode graph of ``batch`` rows: every row one token on the
        scratch page (what padding rows look like)."""
        scratch = self._scratch()
        return AttentionMetadata(
            query_start_loc=list(range(batch + 1)), seq_lens=[1] * batch, block_tables=None,
            slot_mapping=slot_mapping, block_size=self.block_size,
            block_tables_host=np.full((batch, 1), scratch, dtype=np.int64),
            padded_batch=batch)

    def _scratch(self) -> int:
        if self.scratch_block is None:
            raise ValueError("flashinfer backend: bind the engine's KV cache before planning "
                             "a padded decode")
        return self.scratch_block


def flashinfer_import_error() -> str | None:
    """Why ``import flashinfer`` fails here (the exception, in one line), or None."""
    try:
        importlib.import_module("flashinfer")
    except Exception as e:  # not only ImportError: a broken install raises anything
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def flashinfer_importable() -> bool:
    return flashinfer_import_error() is None
