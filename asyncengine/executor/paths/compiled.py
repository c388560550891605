"""The compiled CPU model path (``--compile``): the decoder forward through torch.compile.

Eager PyTorch pays a fixed cost per op (dispatch, allocation, one OpenMP fork per parallel
kernel); a batch-1 decode step of a small model is mostly that cost. Inductor turns the
pointwise and reduction ops between two matmuls into one generated C++ kernel each: the
residual add and the RMSNorm that follows it, RoPE's multiply-adds on q and k, SiLU(gate) *
up, the final norm.

- **Attention stays outside the graph.** It reads and writes the paged KV cache through the
  attention backend, with a per-step plan, so it is one opaque custom op,
  ``asyncengine::paged_attention(q, k, v, layer, scale)``. The op takes the step's KV cache,
  metadata and backend from a per-step context (set around each call), so the graph has no
  graph breaks and no cache tensors among its inputs: one compiled graph per shape. The op
  is declared as mutating nothing: it does write the cache, but nothing in the graph reads
  the cache, so no reordering inside the graph can observe the write.
- **Shape buckets.** A step's token count is padded up to the next bucket (powers of two up
  to ``max_tokens``, then ``max_tokens``); each bucket is compiled with static shapes.
  Padding rows get token id 0 at position 0; the attention op drops them (it attends only
  the step's real tokens and returns zeros for the rest), and their outputs are sliced off.
  A step larger than the last bucket runs eagerly (prefills of that size are compute-bound:
  the per-op cost compilation removes is a small share there).
- **Warm-up and cache.** :meth:`CompiledModel.warm_up` compiles every bucket at start-up,
  behind a progress bar (the attention op returns zeros while warming: there is no step).
  Inductor's FX graph and AOT caches live under ``~/.cache/asyncengine/inductor`` (or
  ``$TORCHINDUCTOR_CACHE_DIR``), so a restart re-traces but does not re-generate or
  re-compile the C++.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from typing import Any

import torch
from torch import nn

from asyncengine.config import environment
from asyncengine.executor.attention.base import AttentionBackend, AttentionMetadata
from asyncengine.executor.paths.base import PathContext, StepPath, begin

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "asyncengine", "inductor")


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two below ``max_tokens``, then ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"compile buckets: max_tokens must be >= 1, got {max_tokens}")
    buckets, b = [], 1
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_tokens)
    return buckets


class _StepContext(threading.local):
    """What the attention op reads while a compiled forward runs on this thread (the op runs
    in the thread that calls the graph; thread-local, so two engines' device threads never
    see each other's step). ``meta is None``: warming up, attention returns zeros."""

    backend: AttentionBackend | None = None
    meta: AttentionMetadata | None = None
    options: list[Any] | None = None  # each layer's attention options (window, soft cap)
    kv_caches: list[torch.Tensor] | None = None
    num_tokens: int = 0


_CTX = _StepContext()


@torch.library.custom_op("asyncengine::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    scale: float) -> torch.Tensor:
    """Attention of the step's real tokens over the paged KV cache (writing their K/V into it);
    [T, heads, head_dim] with zeros in the padding rows."""
    ctx = _CTX
    if ctx.meta is None:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    n = ctx.num_tokens
    options = ctx.options[layer] if ctx.options else None
    if options is None or (options.window is None and options.soft_cap is None):
        o = ctx.backend.forward(q[:n], k[:n], v[:n], ctx.kv_caches[layer], ctx.meta, scale)
    else:
        o = ctx.backend.forward(q[:n], k[:n], v[:n], ctx.kv_caches[layer], ctx.meta, scale,
                                options)
    if n == q.shape[0]:
        return o.contiguous()
    out = q.new_zeros(q.shape)
    out[:n] = o
    return out


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
      scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


class _OpBackend:
    """Stands in for the attention backend inside the traced forward: ``kv_cache`` is the
    layer's index, and the call becomes the custom op (which finds the layer's options, its
    window and soft cap, by that index)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: int,
                meta: Any, scale: float, options: Any = None) -> torch.Tensor:
        return torch.ops.asyncengine.paged_attention(q, k, v, kv_cache, scale)


_OP_BACKEND = _OpBackend()


def supports_compile(model: nn.Module) -> bool:
    """The decoder layout this path traces (``executor/models/decoder.CausalLM``)."""
    inner = getattr(model, "model", None)
    spec = getattr(model, "spec", None)
    if spec is not None and "compile" in spec.lacks():
        return False
    return all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")) and all(
        hasattr(model, a) for a in ("embed", "rope_tables"))


def _decoder(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``CausalLM.forward`` as traced: the same embedding (Gemma's scaled), RoPE tables (one
    per kind of layer: Gemma 3's local and global) and layers, attention through the op."""
    inner = model.model
    h = model.embed(input_ids)  # [T, hidden]
    tables = model.rope_tables(positions, h.dtype)
    residual = None
    for i, layer in enumerate(inner.layers):
        cos, sin = tables[layer.self_attn.rope_name]
        h, residual = layer(h, residual, cos, sin, i, None, _OP_BACKEND)
    return inner.norm(h, residual)[0]


class CompiledModel(nn.Module):
    """``model`` with its forward compiled per token bucket; everything else (logits, weights,
    sizes) is the wrapped model's."""

    def __init__(self, model: nn.Module, max_tokens: int, *,
                 cache_dir: str | None = None) -> None:
        super().__init__()
        if not supports_compile(model):
            raise ValueError(f"--compile: {type(model).__name__} is not the built-in decoder "
                             "(the compiled path traces its layout)")
        self.inner = model
        options = getattr(model, "attention_options", None)
        self.options = options() if options is not None else None
        self.buckets = token_buckets(max_tokens)
        self.compiled_steps = 0  # forwards that ran compiled (the rest ran eagerly)
        configure_inductor(cache_dir)
        # One static-shape graph per bucket, in the cache of a code object of this model's own:
        # dynamo keeps graphs, and counts its recompile limit, per code object, so a second
        # engine in the process (a router's) must not fill the first one's.
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, len(self.buckets) + 4)
        run = CompiledModel._run
        own = types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__,
                                 run.__defaults__, run.__closure__)
        self.code = own.__code__  # (whose cache holds this model's graphs)
        self._compiled = torch.compile(types.MethodType(own, self), dynamic=False,
                                       fullgraph=True)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return _decoder(self.inner, input_ids, positions)

    def bucket_for(self, num_tokens: int) -> int | None:
        for b in self.buckets:
            if num_tokens <= b:
                return b
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                attn_backend: AttentionBackend) -> torch.Tensor:
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            return self.inner(input_ids, positions, kv_caches, attn_metadata, attn_backend)
        # Padded (a copy even when nothing is added): the graph's inputs are always tensors
        # made under inference mode, as at warm-up, or the first step recompiles the bucket.
        input_ids = torch.nn.functional.pad(input_ids, (0, bucket - n))
        positions = torch.nn.functional.pad(positions, (0, bucket - n))
        ctx = _CTX
        ctx.backend, ctx.meta, ctx.kv_caches, ctx.num_tokens = (
            attn_backend, attn_metadata, kv_caches, n)
        ctx.options = self.options
        self.compiled_steps += 1
        try:
            h = self._compiled(input_ids, positions)
        finally:
            ctx.backend = ctx.meta = ctx.kv_caches = None
        return h[:n] if bucket != n else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    @torch.inference_mode()
    def warm_up(self, progress: bool = True) -> float:
        """Compile every bucket (attention returns zeros meanwhile); returns the seconds."""
        start = time.perf_counter()
        device = next(self.inner.parameters()).device
        buckets = self.buckets
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(buckets), desc="compiling the model", unit="bucket")
        for b in buckets:
            ids = torch.zeros(b, dtype=torch.long, device=device)
            self._compiled(ids, torch.arange(b, device=device))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        took = time.perf_counter() - start
        logger.info("compiled the model for %d token buckets (%s) in %.1f s",
                    len(buckets), ", ".join(map(str, buckets)), took)
        return took


def configure_inductor(cache_dir: str | None = None) -> str:
    """Point inductor's on-disk caches at ``cache_dir`` (default: ``$TORCHINDUCTOR_CACHE_DIR``
    or ``~/.cache/asyncengine/inductor``) and turn the FX graph / AOT caches on."""
    path = cache_dir or environment.get(CACHE_DIR_ENV) or default_cache_dir()
    os.makedirs(path, exist_ok=True)
    os.environ[CACHE_DIR_ENV] = path
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return path


class Compiled(StepPath):
    """``--compile``: steps up to the largest bucket through the compiled forward; a larger
    step is declined (the per-layer path runs it)."""

    name = "compiled"

    @classmethod
    def requested(cls, ctx: PathContext) -> bool:
        return ctx.config is not None and ctx.config.device.compile

    @classmethod
    def why_not(cls, ctx: PathContext) -> str | None:
        if not cls.requested(ctx):
            return "--compile not given"
        if ctx.device_type != "cpu":
            return "--compile is for the CPU (CUDA replays CUDA graphs)"
        if ctx.tp is not None:
            return "not with tensor parallelism"
        spec = getattr(ctx.model, "spec", None)
        if spec is not None and "compile" in spec.lacks():
            return spec.lacks()["compile"]
        if not supports_compile(ctx.model):
            return f"{type(ctx.model).__name__} is not the built-in decoder"
        return None

    def __init__(self, ctx: PathContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        max_tokens = min(config.device.compile_max_tokens,
                         config.scheduler.max_num_batched_tokens)
        self.model = CompiledModel(ctx.model, max_tokens)
        ctx.device.run_at_start_up(self.model.warm_up)

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor | None:
        if self.model.bucket_for(inputs.num_tokens) is None:
            return None
        r = self.runner
        begin(inputs, last_sampled, r.attn_backend)
        return self.model(inputs.input_ids, inputs.positions, r.kv_caches,
                          inputs.attn_metadata, r.attn_backend)

    def describe(self) -> str:
        return f"compiled (token buckets up to {self.model.buckets[-1]})"
