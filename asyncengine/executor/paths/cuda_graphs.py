"""CUDA graphs for decode steps, over padded batch-size buckets.

A decode step of an eager model launches a few hundred small kernels; at batch 1 the launches,
not the GPU, set the pace. So the forward pass of a pure-decode step (every request one token)
is captured once per batch-size bucket and replayed: one launch per step.

* Buckets (:func:`capture_sizes`) are vLLM's: 1, 2, 4, then every multiple of 8 up to 256,
  then of 16 up to 512, cut at ``--max-num-seqs`` (which is added as the last bucket when it
  falls between two), so every decode batch the scheduler can form has one. A step of ``n``
  requests replays the smallest bucket ``>= n`` (:func:`bucket_for`); with no such bucket
  (more than 512 requests) it runs eagerly. ``--enforce-eager`` captures nothing.
* Static inputs: the captured graph reads its token ids, positions and slot mapping from fixed
  buffers, and FlashInfer's decode wrapper for that bucket reads fixed indptr / indices /
  last-page-length buffers. Before a replay the step's values are copied in and the rows past
  ``n`` are padded (:func:`fill_static`): token 0 at position 0, K/V written to the
  attention backend's scratch slot, attending only the scratch page. Their outputs are
  dropped; sampling and logits run eagerly on the ``n`` real rows.
* All graphs share one memory pool (they replay one at a time on one stream); the largest is
  captured first so the smaller ones fit in its memory.

Only backends that declare ``supports_cuda_graphs`` (flashinfer) are captured; torch_paged's
plan depends on the batch's lengths and is not capturable. Never run on a GPU yet: the bucket
arithmetic and the padding are tested on the CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from asyncengine.executor.attention.base import AttentionBackend
from asyncengine.executor.paths.base import DECODE, PathContext, StepPath

logger = logging.getLogger("asyncengine")

#: The largest batch captured; bigger decode batches run eagerly (vLLM's default limit).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes to capture for a scheduler of at most ``max_num_seqs`` requests."""
    if max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be positive, got {max_num_seqs}")
    candidates = [1, 2, 4, *range(8, 257, 8), *range(272, limit + 1, 16)]
    top = min(max_num_seqs, limit)
    sizes = [s for s in candidates if s <= top]
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def bucket_for(sizes: list[int], n: int) -> int | None:
    """The smallest captured size ``>= n`` (``sizes`` ascending), or None: run eagerly."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def fill_static(static: torch.Tensor, values: torch.Tensor, batch: int, pad: int) -> None:
    """``static[:batch]`` = ``values`` followed by ``pad`` (``batch - len(values)`` times)."""
    n = values.shape[0]
    if n > batch or batch > static.shape[0]:
        raise ValueError(f"cannot place {n} rows in a bucket of {batch} "
                         f"(buffer of {static.shape[0]})")
    static[:n].copy_(values)
    if batch > n:
        static[n:batch].fill_(pad)


class CUDAGraphRunner:
    """Captured decode forwards by bucket, and their static inputs."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[torch.Tensor], sizes: list[int], block_size: int,
                 device: torch.device | str) -> None:
        scratch = getattr(backend, "scratch_block", None)
        if not backend.supports_cuda_graphs or scratch is None:
            raise ValueError(f"the {backend.name} attention backend cannot be captured in "
                             "CUDA graphs (use --enforce-eager)")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = sizes
        self.block_size = block_size
        self.scratch_slot = scratch * block_size
        with torch.inference_mode():
            top = sizes[-1]
            self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
            self.positions = torch.zeros(top, dtype=torch.long, device=device)
            self.slots = torch.full((top,), self.scratch_slot, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}

    def bucket_for(self, n: int) -> int | None:
        return bucket_for(self.sizes, n)

    @torch.inference_mode()
    def capture(self, stream: Any) -> None:
        """Capture every bucket, largest first (CUDA; at start-up, after the KV cache)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            for batch in reversed(self.sizes):
                meta = self.backend.graph_capture_metadata(batch, self.slots[:batch])
                self.backend.prepare(meta)
                self.backend.plan(meta)
                args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta,
                        self.backend)
                for _ in range(2):  # warm-up: lazy initialization, kernel compilation
                    self.model(*args)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.model(*args)
                self.graphs[batch] = (graph, out)
        stream.synchronize()
        logger.info("captured %d CUDA graphs for decode (batch sizes %s..%s) in %.1f s",
                    len(self.graphs), self.sizes[0], self.sizes[-1],
                    time.perf_counter() - start)

    def run(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor:
        """Replay the graph of ``inputs.graph_batch`` for a prepared decode step; the hidden
        states of its real rows. Call on the device's stream, in step order."""
        batch, n = inputs.graph_batch, inputs.num_tokens
        entry = self.graphs.get(batch)
        if entry is None:
            raise RuntimeError(f"no CUDA graph was captured for batch {batch}")
        meta = inputs.attn_metadata
        fill_static(self.input_ids, inputs.input_ids, batch, 0)
        if inputs.from_previous is not None:
            dst, src = inputs.from_previous
            self.input_ids[dst] = last_sampled[src]
        fill_static(self.positions, inputs.positions, batch, 0)
        fill_static(self.slots, meta.slot_mapping, batch, self.scratch_slot)
        self.backend.plan(meta)
        graph, out = entry
        graph.replay()
        return out[:n]


class CUDAGraphs(StepPath):
    """Decode steps that fit a captured batch size replay its graph. ``prepare`` pads such a
    step to its bucket (``runner.graphs.bucket_for``); a step it did not pad is declined."""

    name = "cuda_graphs"
    phases = (DECODE,)

    @classmethod
    def why_not(cls, ctx: PathContext) -> str | None:
        if ctx.device_type != "cuda":
            return "not on CUDA"
        if ctx.config is None:
            return "captured for an engine's --max-num-seqs"
        if ctx.config.model.enforce_eager:
            return "--enforce-eager"
        if ctx.tp is not None:
            return "graphs cannot hold the tensor-parallel collectives yet"
        backend = ctx.runner.attn_backend
        if not backend.supports_cuda_graphs:
            return f"the {backend.name} attention backend cannot be captured"
        return None

    def __init__(self, ctx: PathContext, graphs: CUDAGraphRunner | None = None) -> None:
        """Captures every bucket, unless ``graphs`` are given (captured already)."""
        super().__init__(ctx)
        r = ctx.runner
        if graphs is None:
            graphs = CUDAGraphRunner(r.model, r.attn_backend, r.kv_caches,
                                     capture_sizes(ctx.config.scheduler.max_num_seqs),
                                     r.block_size, ctx.device.torch_device)
            graphs.capture(ctx.device.stream)
        self.graphs = graphs
        r.graphs = graphs  # ``prepare`` pads decode steps to a captured size

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor | None:
        if inputs.graph_batch is None:
            return None
        return self.graphs.run(inputs, last_sampled)

    def describe(self) -> str:
        sizes = self.graphs.sizes
        return f"cuda_graphs (batch sizes {sizes[0]}..{sizes[-1]})"
