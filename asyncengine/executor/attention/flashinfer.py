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

Never run on a GPU yet: CPU tests drive it with a stand-in for the flashinfer module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata
from asyncengine.executor.attention.paged_plan import PagedKVPlan, pad_decode_plan, plan_paged_kv
from asyncengine.executor.staging import pinned

#: FlashInfer's recommended workspace (split-k partial results), shared by every wrapper:
#: they run one after another on one stream.
WORKSPACE_BYTES = 256 << 20


@dataclass
class _StepPlan:
    plan: PagedKVPlan
    wrapper: Any = None  # set by ``plan``


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
        self._cuda = self.device.type == "cuda"
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off for large GQA groups (FlashInfer's advice, as vLLM applies it).
        self._tensor_cores = num_heads // num_kv_heads > 4
        self.prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._tensor_cores)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._planned: dict[int, Any] = {}  # id(wrapper) -> event after its last plan
        self.plan_waits = 0
        self.scratch_block: int | None = None

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
        if step.wrapper is not None:
            return
        p = step.plan
        if metadata.padded_batch is not None:
            wrapper = self.graph_wrapper(metadata.padded_batch)
        elif p.decode_only:
            wrapper = self.decode
        else:
            wrapper = self.prefill
        self._wait_for_last_plan(wrapper)
        indptr = pinned(p.kv_indptr, self._cuda)
        last = pinned(p.kv_last_page_len, self._cuda)
        indices = pinned(p.kv_indices, self._cuda).to(self.device, non_blocking=True)
        common = dict(sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        if wrapper is self.prefill:
            wrapper.plan(pinned(p.qo_indptr, self._cuda), indptr, indices, last,
                         self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
                         causal=True, **common)
        else:
            wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads,
                         self.head_dim, self.block_size, **common)
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._planned[id(wrapper)] = event
        step.wrapper = wrapper

    def _wait_for_last_plan(self, wrapper: Any) -> None:
        event = self._planned.get(id(wrapper))
        if event is not None and not event.query():
            self.plan_waits += 1
            event.synchronize()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if scale != self.sm_scale:
            raise ValueError(f"flashinfer backend: attention scale {scale} differs from the "
                             f"planned head_dim**-0.5 = {self.sm_scale}")
        step = metadata.extra
        if not isinstance(step, _StepPlan) or step.wrapper is None:
            self.plan(metadata)
            step = metadata.extra
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_pages, page_size, kv_heads, dim]
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        return step.wrapper.run(q.contiguous(), (k_cache, v_cache))

    # -- CUDA graphs -------------------------------------------------------------------------
    def graph_wrapper(self, batch: int) -> Any:
        """The decode wrapper with fixed buffers for CUDA graphs of ``batch`` rows. The
        buffers are shared by all batch sizes (graphs replay one at a time on one stream)."""
        wrapper = self._graph_wrappers.get(batch)
        if wrapper is None:
            indptr, indices, last = self._shared_graph_buffers(batch)
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=indptr[:batch + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:batch])
            self._graph_wrappers[batch] = wrapper
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


def flashinfer_importable() -> bool:
    try:
        importlib.import_module("flashinfer")
    except ImportError:
        return False
    return True
