"""A tensor-parallel worker (ranks 1..N-1): the model's shard and nothing else.

It loads its shard, learns the KV-cache size from rank 0, allocates its heads' KV cache, then
repeats: receive a step message (``messages.py``), update its block tables, run the forward
pass and the logits (their collectives pair with rank 0's), until a stop message. It never
samples, schedules or tokenizes. A worker whose parent (rank 0's process, same node) is gone
exits at once; any error ends the process with status 1, which rank 0 sees.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from asyncengine.config import EngineConfig
from asyncengine.executor.attention import AttentionShape, get_attention_backend
from asyncengine.executor.kv.dtype import kv_cache_dtype
from asyncengine.executor.parallel.loader import load_tp_model
from asyncengine.executor.parallel.messages import (
    HEADER,
    STOP,
    BlockTableMirror,
    body_length,
    decode_step,
)
from asyncengine.executor.parallel.state import TPState, init_distributed
from asyncengine.executor.weights.int4 import step_requests
from asyncengine.executor.weights.loader import pick_dtype, resolve_model

logger = logging.getLogger("asyncengine")


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str,
               num_threads: int | None) -> None:
    """The worker process's entry point."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank}: %(message)s")
    # Ctrl-C reaches the whole process group: rank 0 drains and then stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        if num_threads:
            torch.set_num_threads(num_threads)
        tp = init_distributed(rank, world_size, init_method, _device_type(config))
        Worker(config, tp).serve()
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # no interpreter teardown: the process group's threads are not joined


def _device_type(config: EngineConfig) -> str:
    d = config.device.device
    if d == "auto":
        d = "cuda" if torch.cuda.is_available() else "cpu"
    return d


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:  # started by hand on another node: rank 0's end breaks the group
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="asyncengine-tp-parent", daemon=True).start()


class Worker:
    def __init__(self, config: EngineConfig, tp: TPState) -> None:
        self.config, self.tp = config, tp
        mc = config.model
        if _device_type(config) == "cuda":  # written for NCCL; not run in this repository
            local = tp.rank % (tp.world_size // config.parallel.nnodes)
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        source = resolve_model(mc.model, config.load.load_format, mc.revision,
                               config.load.download_dir)
        dtype = pick_dtype(mc.dtype, self.device.type)
        self.model = load_tp_model(source, config.load.load_format, dtype, self.device, tp,
                                   seed=mc.seed, quantization=mc.quantization)
        setup: list[dict | None] = [None]
        dist.broadcast_object_list(setup, src=0, group=tp.control_group)
        num_blocks, max_model_len = setup[0]["num_blocks"], setup[0]["max_model_len"]
        bs = self.block_size = config.cache.block_size
        m = self.model
        shape = AttentionShape(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                               head_dim=m.head_dim, block_size=bs, dtype=dtype,
                               max_pages_per_seq=-(-max_model_len // bs) + 1)
        self.backend = get_attention_backend(config.device.attention_backend,
                                             self.device.type, shape)
        if hasattr(m, "attention_options"):  # the same layer variants as rank 0's backend
            self.backend.configure_layers(m.attention_options())
        if hasattr(m, "configure_context"):  # LongRoPE's factors: as rank 0 chose them
            m.configure_context(max_model_len)
        if self.device.type == "cuda":  # FlashInfer's JIT now, not at the first step
            from asyncengine.executor.attention.prewarm import prewarm_attention
            from asyncengine.executor.kernels import cuda_layer_ops

            self.backend = prewarm_attention(config, self.backend, m, graphs=False)
            cuda_layer_ops.setup(m, dtype, self.device, max_model_len)
        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype, self.device.type)
        self.kv_caches = self.backend.allocate_kv_cache(m.num_layers, num_blocks, bs,
                                                        m.num_kv_heads, m.head_dim, kv_dtype,
                                                        self.device)
        self.backend.bind_kv_cache(self.kv_caches)
        self.mirror = BlockTableMirror(-(-max_model_len // bs) + 1)
        dist.barrier(group=tp.control_group)  # ready: rank 0's build() returns after this

    @torch.inference_mode()
    def serve(self) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        while True:
            self.tp.broadcast(header)
            if int(header[0]) == STOP:
                return
            body = self.tp.broadcast(torch.empty(body_length(header), dtype=torch.int64))
            self.step(header, body)

    def step(self, header: torch.Tensor, body: torch.Tensor) -> None:
        step = decode_step(header, body)
        self.mirror.apply(step.deltas)
        positions, meta = self.mirror.metadata(step, self.block_size, self.backend,
                                               self.device)
        self.backend.plan(meta)
        model = self.model
        with step_requests(meta.num_requests):  # the kernels rank 0 picks (runner.execute)
            hidden = model(step.input_ids.to(self.device), positions, self.kv_caches, meta,
                           self.backend)
            for first, last in step.ranges:  # prompt logprobs, in rank 0's order
                model.compute_logits(hidden[first:last])
            if len(step.sample_indices):
                model.compute_logits(hidden[step.sample_indices.to(self.device)])
