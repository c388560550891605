"""The GPU step path on the CPU: FlashInfer (a stand-in), CUDA graphs (emulated) and the CUDA
device (a simulated stream), with the engine's own model or with a simulated one.

:func:`on_simulated_gpu` puts an engine built on the CPU onto the path it takes on CUDA: the
FlashInfer attention backend over ``flashinfer_standin`` (its plans made from the persistent
batch as on a GPU), decode steps replayed from CUDA graphs captured per batch size (emulated:
a "graph" whose replay re-runs the captured forward on the static buffers), the rest eager,
and the ``CUDADevice`` over a :class:`~asyncengine.executor.runtime.simulated.SimulatedCUDA`.
With the engine's model the outputs are real (tests compare them with the CPU engine's).

With a :class:`SimulatedModel` (``asyncengine bench host``) the forward pass is what a GPU
makes of it for the host: the host enqueues it and goes on. Its time, from a
:class:`StepTime` model, is enqueued on the simulated stream, and the host pays one small
gather per forward (a graph replay is one launch on a GPU) and one per logits; every other
host step of the engine is the real one: the persistent batch, FlashInfer's paged plans and
the stand-in's ``plan`` calls, the static-buffer copies, sampling's few ops on a small
vocabulary, the staging's packed upload, the events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.executor.attention.flashinfer import FlashInferBackend
from asyncengine.executor.paths.base import PathContext
from asyncengine.executor.paths.choose import plan_of
from asyncengine.executor.paths.cuda_graphs import CUDAGraphRunner, CUDAGraphs, capture_sizes
from asyncengine.executor.paths.eager import Eager
from asyncengine.executor.runtime.flashinfer_standin import make_module
from asyncengine.executor.runtime.simulated import SimulatedCUDA, on_simulated_cuda


@dataclass(frozen=True)
class StepTime:
    """The GPU's time for a forward pass of ``tokens`` tokens (a CUDA graph's: its batch
    size): ``fixed_s + per_token_s * tokens``."""

    fixed_s: float
    per_token_s: float = 0.0

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


class SimulatedModel(torch.nn.Module):
    """A causal LM whose forward pass runs on the simulated GPU: it enqueues its
    :class:`StepTime` on ``stream`` (when one is attached) and returns, as the "hidden
    states", each token's successor in a fixed permutation of the vocabulary's ids from
    ``first_token`` on; ``compute_logits`` makes them one-hot logits, so greedy sampling
    picks them. The attention geometry is only what the backend plans with."""

    def __init__(self, vocab_size: int, step_time: StepTime, *, first_token: int = 0,
                 num_layers: int = 1, num_heads: int = 4, num_kv_heads: int = 2,
                 head_dim: int = 16) -> None:
        super().__init__()
        if not 0 <= first_token < vocab_size:
            raise ValueError(f"first_token {first_token} outside a vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.step_time = step_time
        self.num_layers, self.num_heads = num_layers, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        span = vocab_size - first_token
        ids = torch.arange(vocab_size)
        # 7 steps through the span, coprime to it or not: a varied text either way.
        self.register_buffer("successor", first_token + (ids * 7 + 3) % span, persistent=False)
        self.register_buffer("one_hot", torch.eye(vocab_size), persistent=False)
        self.stream: Any = None  # a SimulatedStream; none while graphs are captured

    @classmethod
    def like(cls, model: Any, step_time: StepTime, first_token: int = 0) -> SimulatedModel:
        """One with ``model``'s vocabulary and attention geometry."""
        return cls(model.vocab_size, step_time, first_token=first_token,
                   num_layers=model.num_layers, num_heads=model.num_heads,
                   num_kv_heads=model.num_kv_heads, head_dim=model.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                metadata: Any, backend: Any) -> torch.Tensor:
        if self.stream is not None:
            n = input_ids.shape[0]
            self.stream.enqueue(self.step_time(n), n)
        return self.successor[input_ids]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.one_hot[hidden]


class RerunGraph:
    """A stand-in CUDA graph: replaying re-runs the captured forward on the same static
    buffers and metadata (what a real replay computes)."""

    def __init__(self, forward: Any, out: torch.Tensor) -> None:
        self.forward, self.out = forward, out
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.forward())


@torch.inference_mode()
def emulate_capture(graphs: CUDAGraphRunner) -> None:
    """``CUDAGraphRunner.capture`` with :class:`RerunGraph`s, largest batch first."""
    backend = graphs.backend
    for batch in reversed(graphs.sizes):
        meta = backend.graph_capture_metadata(batch, graphs.slots[:batch])
        backend.prepare(meta)
        backend.plan(meta)

        def forward(batch=batch, meta=meta):
            return graphs.model(graphs.input_ids[:batch], graphs.positions[:batch],
                                graphs.kv_caches, meta, backend)

        out = forward().clone()  # the "capture": the graph's output buffer
        graphs.graphs[batch] = (RerunGraph(forward, out), out)


def on_simulated_gpu(engine: Any, graphs: bool = True, *, awaiter: str | None = "thread",
                     cuda: SimulatedCUDA | None = None,
                     model: SimulatedModel | None = None) -> FlashInferBackend:
    """Put ``engine`` (an ``AsyncEngine`` built on the CPU) on the GPU path: FlashInfer
    (stand-in), with ``graphs`` emulated CUDA graphs for decode (else every step eager), on
    the CUDA device over ``cuda``. ``model``: the runner's model from now on (its
    vocabulary must be the engine's); its stream is attached once the graphs are captured.
    Returns the attention backend."""
    runner = engine.runner
    if model is not None:
        if model.vocab_size != runner.vocab_size:
            raise ValueError(f"the simulated model's vocabulary ({model.vocab_size}) is not "
                             f"the engine's ({runner.vocab_size})")
        runner.model = model
        runner.greedy_head = False  # as on CUDA
    model = runner.model
    bs = runner.block_size
    fi, _ = make_module()
    backend = FlashInferBackend(model.num_heads, model.num_kv_heads, model.head_dim, bs,
                                torch.float32, "cpu", max_pages_per_seq=runner.batch.max_blocks,
                                module=fi, workspace_bytes=64)
    runner.kv_caches = backend.allocate_kv_cache(model.num_layers, engine.parts.num_blocks, bs,
                                                 model.num_kv_heads, model.head_dim,
                                                 torch.float32, "cpu")
    backend.bind_kv_cache(runner.kv_caches)
    if hasattr(model, "attention_options"):  # as build() does: the layers' variants
        backend.configure_layers(model.attention_options())
    runner.attn_backend = backend
    if graphs:
        runner.graphs = CUDAGraphRunner(model, backend, runner.kv_caches,
                                        capture_sizes(engine.config.scheduler.max_num_seqs),
                                        bs, "cpu")
        emulate_capture(runner.graphs)
    device = on_simulated_cuda(engine, awaiter, cuda)
    ctx = PathContext(runner, device, engine.config)
    if graphs:  # as the chooser makes it on CUDA: decode steps replay, the rest run eagerly
        runner.paths = plan_of(CUDAGraphs(ctx, runner.graphs), Eager(ctx))
    elif isinstance(model, SimulatedModel):
        runner.paths = plan_of(Eager(ctx))
    if isinstance(model, SimulatedModel):
        model.stream = device.stream
    return backend
