"""The decoder layer's small ops on CUDA, one FlashInfer kernel each.

A batch-1 decode step of a small model is a chain of a few hundred kernels; inside a CUDA
graph each still costs a few microseconds however little it computes. The first GPU run
(an H100, Llama-3.2-1B's shape) kept the GPU busy 1.95 ms a token against 0.82 ms of weight
reads: the PyTorch path below a layer's norms, RoPE and SiLU is ~16 kernels a layer, these
make it 4:

- ``rms_norm``: the residual add and the RMSNorm after it (``fused_add_rmsnorm``, in place),
  Gemma's ``1 + w`` form too (``gemma_*``);
- ``rope_``: RoPE on q and k in place in the fused qkv output, from a float32 table of
  ``cos | sin`` for every position (``apply_rope_with_cos_sin_cache_inplace``); the table is
  made once, so a step no longer computes cos and sin either;
- ``act_mul``: SiLU (or tanh-GELU) of the gate times up (``silu_and_mul``).

They compute in float32 and round once, where the PyTorch path (as transformers does) rounds
after each op: the same to bfloat16 precision, not to the bit. So they serve bfloat16 and
float16 models only; float32 keeps the PyTorch path (the exact comparisons against
transformers). Each is a FlashInfer JIT module: :func:`prewarm` compiles them at start-up
with the attention kernels; a failure leaves the PyTorch path, with one warning.
``ASYNCENGINE_CUDA_LAYER_OPS=0`` turns them off (for comparisons).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from asyncengine.config import environment

logger = logging.getLogger("asyncengine")

ENV = "ASYNCENGINE_CUDA_LAYER_OPS"
DTYPES = (torch.bfloat16, torch.float16)
ACTIVATIONS = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}


class _State:
    module: Any = None  # the flashinfer package (or a stand-in), once prewarmed
    device_type = "cuda"
    activations: frozenset[str] = frozenset()
    failed: str | None = None  # why the JIT failed: tried once a process, not at every engine


_state = _State()


def enabled_by_env() -> bool:
    return environment.on(ENV)


def prewarm(device: torch.device | str, dtype: torch.dtype,
            activations: tuple[str, ...] = ("silu",), module: Any = None) -> float:
    """Compile and run each op once (FlashInfer's JIT: a minute or two the first time on a
    machine, cached on disk after), then route the model's ops to them. Returns the seconds
    it took; raises what the JIT raises (the ops then stay off)."""
    import time

    start = time.perf_counter()
    module = compile_ops(device, dtype, ("norm", "rope", *activations), module)
    _state.module, _state.device_type = module, torch.device(device).type
    _state.activations = frozenset(activations)
    return time.perf_counter() - start


def compile_ops(device: torch.device | str, dtype: torch.dtype,
                which: tuple[str, ...] = ("norm", "rope", *ACTIVATIONS),
                module: Any = None) -> Any:
    """Compile and run once each JIT module of ``which`` ("norm", "rope", or an activation of
    ``ACTIVATIONS``); separate processes may compile separate ones side by side
    (``python -m asyncengine.executor.runtime.prewarm --parts``). Returns the module used."""
    if module is None:
        import flashinfer
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope

        module = flashinfer
    device = torch.device(device)
    x = torch.randn(2, 128, dtype=dtype, device=device)
    w = torch.ones(128, dtype=dtype, device=device)
    if "norm" in which:
        module.norm.rmsnorm(x, w, 1e-6, enable_pdl=False)
        module.norm.fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-6, enable_pdl=False)
        module.norm.gemma_rmsnorm(x, w, 1e-6, enable_pdl=False)
        module.norm.gemma_fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-6, enable_pdl=False)
    for name in (n for n in which if n in ACTIVATIONS):
        getattr(module.activation, ACTIVATIONS[name])(x, enable_pdl=False)
    if "rope" in which:
        qk = torch.randn(2, 3 * 64, dtype=dtype, device=device)
        table = torch.zeros(4, 64, dtype=torch.float32, device=device)
        module.rope.apply_rope_with_cos_sin_cache_inplace(
            torch.arange(2, device=device), qk[:, :128], qk[:, 128:], 64, table, is_neox=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return module


def disable() -> None:
    _state.module, _state.activations = None, frozenset()


def usable(x: torch.Tensor) -> bool:
    """Whether the ops run for activations like ``x``: prewarmed, on their device, bfloat16
    or float16, eager or in a CUDA graph (not under ``torch.compile``)."""
    return (_state.module is not None and x.device.type == _state.device_type
            and x.dtype in DTYPES and not torch.compiler.is_compiling())


def active() -> bool:
    """Prewarmed and on: the layers' norms, RoPE and activations take FlashInfer's kernels."""
    return _state.module is not None


def has_activation(name: str) -> bool:
    return name in _state.activations


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, gemma: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, N] -> ``weight * norm(x)`` (``(1 + weight) *`` for ``gemma``). With
    ``residual`` [T, N]: ``residual`` becomes ``x + residual`` and ``x`` its norm, both in
    place; returns ``(x, residual)``."""
    norm = _state.module.norm
    if residual is None:
        fn = norm.gemma_rmsnorm if gemma else norm.rmsnorm
        return fn(x.contiguous(), weight, eps, enable_pdl=False)
    if not x.is_contiguous():
        x = x.contiguous()
    fn = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    fn(x, residual, weight, eps, enable_pdl=False)
    return x, residual


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``gate_up`` [T, 2 I] -> ``act(gate) * up`` [T, I]."""
    fn = getattr(_state.module.activation, ACTIVATIONS[activation])
    return fn(gate_up.contiguous(), enable_pdl=False)


class RopeTable(NamedTuple):
    """What a step's layers need for FlashInfer's RoPE: the step's positions [T] and the
    table [max_positions, rotary_dim] (float32, ``cos`` then ``sin`` halves)."""

    positions: torch.Tensor
    cos_sin: torch.Tensor

    def apply_(self, q: torch.Tensor, k: torch.Tensor, head_dim: int) -> None:
        """RoPE (neox halves) in place on ``q`` [T, heads * head_dim] and ``k`` [T, kv_heads *
        head_dim]: views into the fused qkv output (rows strided, each row's heads
        contiguous)."""
        _state.module.rope.apply_rope_with_cos_sin_cache_inplace(
            self.positions, q, k, head_dim, self.cos_sin, is_neox=True)


def cos_sin_table(inv_freq: torch.Tensor, scaling: float, max_positions: int,
                  device: torch.device | str) -> torch.Tensor:
    """The float32 ``cos | sin`` table for positions ``[0, max_positions)``: the same
    float32 angles as ``RotaryEmbedding._compute``, not rounded to the model's dtype."""
    positions = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.to(device)[None, :]  # [P, rotary_dim / 2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1).contiguous()


def setup(model: Any, dtype: torch.dtype, device: torch.device | str,
          max_model_len: int, module: Any = None) -> bool:
    """At start-up on CUDA, after the attention kernels: compile the ops for ``model`` and
    give its RoPE tables their ``cos | sin`` table, unless ``ASYNCENGINE_CUDA_LAYER_OPS=0``,
    the dtype is float32, or the model is not one of the built-in decoder's. A failure keeps
    the PyTorch path, with one warning naming it. Returns whether the ops are on.
    ``module``: a stand-in for ``flashinfer`` (tests)."""
    spec = getattr(model, "spec", None)
    if not enabled_by_env() or dtype not in DTYPES or spec is None \
            or not hasattr(model, "use_cuda_rope_tables"):
        disable()
        return False
    activations = (spec.activation,) if spec.activation in ACTIVATIONS else ()
    try:
        if _state.failed is not None and module is None:
            raise RuntimeError(_state.failed)
        seconds = prewarm(device, dtype, activations, module=module)
    except Exception as e:  # the JIT's failure: a compiler error, a missing source
        disable()
        text = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
        if module is None:
            _state.failed = text
        logger.warning("decoder layer ops in PyTorch, not FlashInfer's fused kernels: %s", text)
        return False
    model.use_cuda_rope_tables(max_model_len, torch.device(device))
    # once at the model's own sizes, outside any CUDA graph's capture (kernels that a backend
    # specializes by size are built now)
    x = torch.zeros(1, spec.hidden, dtype=dtype, device=device)
    rms_norm(x, torch.ones(spec.hidden, dtype=dtype, device=device), 1e-6, x.clone())
    for name in activations:
        act_mul(torch.zeros(1, 2 * spec.intermediate, dtype=dtype, device=device), name)
    path = "CUDA JIT" if getattr(_state.module.norm, "_USE_CUDA_NORM", True) else "CuTe DSL"
    logger.info("FlashInfer's fused layer ops (norm: %s; RoPE; %s) compiled and loaded in "
                "%.1f s", path, "/".join(activations) or "no activation", seconds)
    return True
