"""How many KV-cache blocks fit: ``--gpu-memory-utilization`` with vLLM's meaning.

``--gpu-memory-utilization U`` is the fraction of the GPU's TOTAL memory this engine may use,
all of it: weights, activations, the KV cache, and the memory CUDA libraries take outside
torch's allocator. The KV cache gets what is left of ``U x total`` after a profiling run::

    kv_budget = U * total - peak_torch - non_torch

* ``peak_torch``: ``torch.cuda.max_memory_reserved()`` (what torch's caching allocator holds
  from the device, allocated or cached: the device cannot give cached blocks to the KV
  cache, so allocated alone would overcommit) over a dummy forward pass of
  ``--max-num-batched-tokens`` tokens (spread over up to ``--max-num-seqs`` requests) and the
  sampler at ``--max-num-seqs`` rows (top-k/top-p through a full sort, and logprobs: the
  torch path's worst case), counting the weights; minus the small KV cache the dummy pass
  itself needed.
* ``non_torch``: how much the memory the device reports in use, beyond what torch has
  reserved, grew since the device was created (cuBLAS and FlashInfer workspaces, ...). Memory
  other processes hold is not counted, as in vLLM: instead, at start-up ``U x total`` must not
  exceed the free memory.

CUDA graphs are captured after the KV cache is allocated; their memory (a pool the size of
the largest decode bucket's activations) comes out of the ``1 - U`` margin.
The arithmetic is plain functions of the numbers (unit-tested on the CPU); the profiling run
needs CUDA and has not run on a GPU yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncengine.config import parse_size
from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata
from asyncengine.executor.sampler.batch import SamplingBatch
from asyncengine.executor.sampler.logprobs import logprob_tensors
from asyncengine.executor.sampler.sampler import sample_ids

if TYPE_CHECKING:
    from asyncengine.config import EngineConfig

logger = logging.getLogger("asyncengine.executor.build")

CPU_KV_CACHE_DEFAULT = 1 << 30  # 1 GiB: ~45k tokens of the embedded model in bfloat16

GIB = 1 << 30


@dataclass
class MemorySnapshot:
    free: int
    total: int
    reserved: int  # by torch's caching allocator

    @property
    def non_torch(self) -> int:
        """Memory in use on the device that torch did not allocate (this process's CUDA
        context and libraries, and other processes)."""
        return self.total - self.free - self.reserved


def check_free_memory(at_start: MemorySnapshot, utilization: float) -> None:
    """vLLM's start-up check: the engine's share of the GPU must be free when it starts."""
    wanted = utilization * at_start.total
    if at_start.free < wanted:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: the engine may use {wanted / GIB:.2f} GiB "
            f"of the GPU's {at_start.total / GIB:.2f} GiB, but only {at_start.free / GIB:.2f} "
            "GiB are free (other processes hold the rest); lower it, or free the GPU")


def kv_cache_budget(total: int, utilization: float, peak_torch: int, non_torch: int) -> int:
    """Bytes the KV cache may take (negative: nothing is left)."""
    return int(total * utilization) - peak_torch - non_torch


def kv_blocks_for_budget(budget: int, bytes_per_block: int, block_size: int,
                         max_model_len: int, *, extra_blocks: int = 0,
                         flag: str = "--gpu-memory-utilization") -> int:
    """Blocks that fit in ``budget`` (after ``extra_blocks`` the backend keeps for itself);
    a ``ValueError`` naming ``flag`` when they hold less than one full-length request."""
    num_blocks = max(budget, 0) // bytes_per_block - extra_blocks
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        also = (", or --max-num-batched-tokens (a smaller profiled peak)"
                if flag == "--gpu-memory-utilization" else "")
        raise ValueError(
            f"{flag}: {max(budget, 0) / GIB:.2f} GiB are left for the KV cache, "
            f"{max(num_blocks, 0)} blocks of {block_size} tokens, fewer than one full-length "
            f"request needs ({needed} blocks for --max-model-len {max_model_len}); raise "
            f"{flag} or lower --max-model-len{also}")
    return num_blocks


@torch.inference_mode()
def dummy_forward(model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                  num_tokens: int, num_seqs: int, max_sample_rows: int, dtype: torch.dtype,
                  device: torch.device | str) -> int:
    """A forward pass of ``num_tokens`` prompt tokens in up to ``num_seqs`` requests, then the
    sampler and logprobs over ``max_sample_rows`` rows: the engine's peak-memory step.
    Returns the bytes of the temporary KV cache it allocated."""
    seqs = max(1, min(num_seqs, num_tokens))
    lens = np.full(seqs, num_tokens // seqs, dtype=np.int64)
    lens[: num_tokens % seqs] += 1
    blocks = (lens + block_size - 1) // block_size
    first = np.concatenate([[0], np.cumsum(blocks)])
    kv = backend.allocate_kv_cache(model.num_layers, int(first[-1]), block_size,
                                   model.num_kv_heads, model.head_dim, dtype, device)
    width = int(blocks.max())
    table = first[:-1, None] + np.minimum(np.arange(width)[None, :], blocks[:, None] - 1)
    slots = np.concatenate([first[i] * block_size + np.arange(n) for i, n in enumerate(lens)])
    starts = np.concatenate([[0], np.cumsum(lens)])
    meta = AttentionMetadata(
        query_start_loc=starts.tolist(), seq_lens=lens.tolist(),
        block_tables=torch.from_numpy(table).to(device), slot_mapping=torch.from_numpy(slots)
        .to(device), block_size=block_size, block_tables_host=table)
    backend.prepare(meta)
    backend.plan(meta)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(device)
    hidden = model(ids, positions, kv, meta, backend)
    rows = torch.arange(max_sample_rows, device=device) % num_tokens
    logits = model.compute_logits(hidden[rows])
    r = max_sample_rows
    batch = SamplingBatch.from_columns(
        temperature=[0.8] * r, top_k=[50] * r, top_p=[0.9] * r, min_p=[0.0] * r,
        seeds=[None] * r, counters=[0] * r, logprobs=[20] * r, device=device)
    token_ids = sample_ids(logits, batch)
    logprob_tensors(logits, token_ids, 20)
    return sum(t.numel() * t.element_size() for t in kv)


def profile_cuda_memory(model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                        num_tokens: int, num_seqs: int, dtype: torch.dtype,
                        device: torch.device | str,
                        baseline: MemorySnapshot) -> tuple[int, int]:
    """``(peak_torch, non_torch)`` for :func:`kv_cache_budget`, from :func:`dummy_forward` on
    CUDA. ``baseline``: the snapshot taken when the device was created."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    kv_bytes = dummy_forward(model, backend, block_size, num_tokens, num_seqs, num_seqs, dtype,
                             device)
    torch.cuda.synchronize()
    # Reserved, not allocated: the allocator's cache (rounding, fragmentation) is memory the
    # KV cache cannot have either.
    peak = max(torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()) - kv_bytes
    now = cuda_snapshot()
    torch.cuda.empty_cache()
    return peak, max(0, now.non_torch - baseline.non_torch)


def cuda_snapshot() -> MemorySnapshot:
    free, total = torch.cuda.mem_get_info()
    return MemorySnapshot(free=free, total=total, reserved=torch.cuda.memory_reserved())


def max_model_len_of(config: EngineConfig, hf_config: Any) -> int:
    """The context length: ``--max-model-len``, at most the model's own (ValueError naming
    the flag beyond it), else the model's capped at 8192."""
    # A sliding window bounds what attention sees, not the context: the context is the
    # model's position limit (or --max-model-len).
    from asyncengine.executor.models.family import text_config

    native = getattr(text_config(hf_config), "max_position_embeddings", None) or 2048
    wanted = config.model.max_model_len
    if wanted is None:
        return min(native, 8192)
    if wanted > native:
        raise ValueError(f"--max-model-len {wanted} exceeds the model's context length "
                         f"({native})")
    return wanted


def auto_kv_size(config: EngineConfig) -> bool:
    """Whether the KV cache is sized by measurement (no override, no fixed size)."""
    cc = config.cache
    return cc.num_gpu_blocks_override is None and cc.kv_cache_memory == "auto"

def num_kv_blocks(config: EngineConfig, model: torch.nn.Module, attn_backend: Any,
                  dtype: torch.dtype, device: torch.device, max_model_len: int,
                  at_start: MemorySnapshot | None = None) -> int:
    """KV-cache blocks: the override, ``--kv-cache-memory``, the CUDA profile under
    ``--gpu-memory-utilization``, or ``CPU_KV_CACHE_DEFAULT`` on the CPU."""
    cc = config.cache
    if cc.num_gpu_blocks_override is not None:
        return cc.num_gpu_blocks_override
    per_block = attn_backend.bytes_per_block(model.num_layers, cc.block_size,
                                             model.num_kv_heads, model.head_dim, dtype)
    flag = "--kv-cache-memory"
    if cc.kv_cache_memory != "auto":
        budget = parse_size(cc.kv_cache_memory, "kv_cache_memory")
    elif at_start is not None:  # the device sizes it by a memory profile
        sc = config.scheduler
        peak, non_torch = profile_cuda_memory(
            model, attn_backend, cc.block_size, sc.max_num_batched_tokens, sc.max_num_seqs,
            dtype, device, at_start)
        budget = kv_cache_budget(at_start.total, cc.gpu_memory_utilization, peak, non_torch)
        flag = "--gpu-memory-utilization"
        logger.info("memory profile: peak %.2f GiB in torch, %.2f GiB outside it; KV cache "
                    "budget %.2f GiB", peak / 2**30, non_torch / 2**30, budget / 2**30)
    else:
        budget = CPU_KV_CACHE_DEFAULT
    return kv_blocks_for_budget(budget, per_block, cc.block_size, max_model_len,
                                extra_blocks=attn_backend.extra_kv_blocks, flag=flag)
