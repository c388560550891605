"""A decode step's decoder layers in one C++ call (CPU, eager; int4 weights or GGUF weights
kept packed, in float32 or bfloat16).

At one decode token a SmolLM2-135M step is 30 layers of ~15 calls each (4 int4 matmuls, the
norms, RoPE, the K/V write, attention, SiLU * up) with the module calls, views and
allocations around them: measured on a 2-core AVX2 machine, ~6 ms of a ~15 ms step was
Python and PyTorch between the kernels, and each small kernel cost 6-15 us per call, mostly
not its arithmetic. ``kernels/decode_stack.cpp`` calls the same kernels in the same order
from C++, for every layer: the step's hidden states go in after the embedding and come out
after the final norm, to the bit what the per-op path computes.

It runs when a step is all decodes that ``torch_paged`` attends with its in-place kernel
(``TorchPagedBackend.decode_plan``), for a model of any family (``stack_model.py`` reads its
description: Gemma's norms, q / k norms, GELU-tanh, windows, soft caps, per-layer RoPE tables,
partial rotary, biases, mixtures of experts) whose projections are each of a weight format
of ``stack_formats.py``, multiplied as its module multiplies them: int4 (``Int4Linear``: the
default for the embedded Q4_1 GGUF and ``--quantization int4``; in bfloat16 through its
bfloat16 kernel, where it runs, and, for steps of ``int4.TILE_REQUESTS`` requests or more,
its byte tiles) or a GGUF
file's blocks kept packed (``GGUFLinear``, ``--quantization gguf``: Q4_K_M's mix of types, a
fused projection's parts in their own types, Qwen2's q/k/v bias); and when the step has
fewer tokens than every projection's module keeps to its own kernel for (``max_rows``).
Anything else takes the per-layer path. ``ASYNCENGINE_CPU_KERNELS=0`` turns it off with the
other own kernels.

The stack's parameters are the structs of ``kernels/stack_layout.h`` (``stack_layout.py``):
the model's (its layers', each projection with its weight format) built once here, the
step's filled per call.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.kernels.build import DTYPE_CODES, KV_CODES, load
from asyncengine.executor.paths import stack_formats, stack_layout, stack_model
from asyncengine.executor.paths.base import DECODE, PathContext, StepPath, begin
from asyncengine.executor.paths.stack_layout import AeStep
from asyncengine.executor.paths.stack_model import StackModel

# the addresses of the model's and the step's structs of kernels/stack_layout.h
# (``stack_layout.py``); or 0, 0 and where to write their layout
_ARGS = ("uintptr_t", "uintptr_t", "uintptr_t")
# the projections LoRA adapts, by AeLayer field
_PROJS = (("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"),
          ("gate_up", "mlp.gate_up_proj"), ("down", "mlp.down_proj"))


@functools.cache
def _load(dtype: torch.dtype, kv_code: int = 0) -> Any:
    """The compiled stack for activations of ``dtype`` and that KV cache, its struct layout
    checked against ``stack_layout.py``'s (None where it does not build)."""
    fn = load("decode_stack", _ARGS, DTYPE_CODES[dtype], kv_code=kv_code)
    if fn is not None:
        stack_layout.check(fn)
    return fn


class DecodeStack:
    """The model's layers as the structs of ``kernels/stack_layout.h``, for
    ``decode_stack.cpp``."""

    def __init__(self, model: Any, dtype: torch.dtype = torch.float32) -> None:
        self.fn = _load(dtype)
        self.dtype = dtype  # of the activations and norms (and the KV cache, but float8)
        self.num_layers = model.num_layers
        self.num_kv_heads, self.hidden = model.num_kv_heads, model.hidden_size
        built = self.built = StackModel(model, dtype)
        self.layers, self.ropes = built.layers, built.ropes  # RoPE tables by AeLayer.rope
        self.formats = built.format_names
        # the most tokens a step may have: every projection's module keeps to its kernel
        self.max_rows = built.max_rows
        # int4 in bfloat16: from this many requests a step's matmuls take the byte tiles
        # (never, where they are not compiled in: Int4Linear then keeps the row kernel)
        self.tile_requests = built.tile_requests
        self.step = AeStep()
        self._args = (stack_layout.address(built.model), stack_layout.address(self.step), 0)
        self._fp8_fns: dict[torch.dtype, Any] = {}  # the stack for a float8 KV cache
        self._caches: tuple[int, ...] = ()
        self._cache_tensors: list[torch.Tensor] = []
        # --enable-lora: the adapters' slot tables (``executor/lora/tables.py``), which each
        # projection's struct points at, so that steps with adapter rows stay in the stack
        self.lora_table: Any = None
        self.lora_steps = 0  # steps run with adapter rows
        tables = getattr(getattr(model, "lora", None), "tables", None)
        # GGUF, or int4 in bfloat16: steps with adapter rows go per layer
        if (tables is not None and self.formats == (stack_formats.Int4.name,)
                and dtype == torch.float32 and self._lora(tables)):
            self.lora_table = tables

    def _lora(self, tables: Any) -> bool:
        """Each projection's LoRA slot tables, when every layer's four have them."""
        found = [[tables.get(f"model.layers.{i}.{name}") for _, name in _PROJS]
                 for i in range(self.num_layers)]
        if any(t is None for row in found for t in row):
            return False
        for row, w in zip(found, self.layers, strict=True):
            for t, (field, _) in zip(row, _PROJS, strict=True):
                p, point = getattr(w, field), self.built.point
                p.lora_a, p.lora_b = point(t.A), point(t.B)
                p.lora_rows, p.lora_span = point(t.rows), point(t.span)
                p.lora_r = t.A.shape[1]
        return True

    @classmethod
    def why_not(cls, model: Any) -> str | None:
        """None when the stack can run ``model``'s decode steps, else why not (see the module
        doc)."""
        spec = getattr(model, "spec", None)
        if spec is None:
            return "not a built-in family's decoder"
        if not layer_ops.ENABLED:
            return f"{layer_ops.ENV}=0"
        dtype = model.model.norm.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return f"{str(dtype).removeprefix('torch.')} activations"
        why = stack_model.why_not(model, dtype)
        if why is not None:
            return why
        if _load(dtype) is None:
            return "the C++ stack did not build"
        return None

    @classmethod
    def for_model(cls, model: Any) -> DecodeStack | None:
        """The stack for ``model``, or None where it does not apply (:meth:`why_not`)."""
        if cls.why_not(model) is not None:
            return None
        return cls(model, model.model.norm.weight.dtype)

    def run(self, h: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
            kv_caches: list[torch.Tensor], meta: Any, backend: Any,
            lora: Any = None) -> torch.Tensor | None:
        """h: the step's embeddings [T, hidden] -> the final normed hidden states, or None
        when this step is not one the stack runs (the caller takes the per-layer path).
        ``tables``: each RoPE table's (cos, sin) at the step's positions, by the name the
        layers' ``LayerSpec.rope`` give. ``lora``: the step's ``lora.ops.LoRAStep`` when it
        has adapter rows."""
        T = h.shape[0]
        if T >= self.max_rows or h.dtype != self.dtype or not layer_ops.usable(h):
            return None
        if lora is not None and (self.lora_table is None or lora.slots.device.type != "cpu"
                                 or lora.segments is not None):
            return None
        plan_of = getattr(backend, "decode_plan", None)
        plan = plan_of(meta, h, self.num_kv_heads) if plan_of is not None else None
        if plan is None:
            return None
        kv = kv_caches[0]
        fn = self.fn if kv.dtype == self.dtype else self._fp8_fn(kv.dtype)
        if fn is None or kv.stride(0) != kv_caches[-1].stride(0):
            return None
        self._point_at(kv_caches)
        h = h.contiguous()
        out = torch.empty(T, self.hidden, dtype=self.dtype)
        s = self.step
        s.h, s.out, s.tokens = h.data_ptr(), out.data_ptr(), T
        for i, name in enumerate(self.ropes):
            cos, sin = tables[name]
            s.cos[i], s.sin[i] = cos.data_ptr(), sin.data_ptr()
        s.slots, s.tables = meta.slot_mapping.data_ptr(), plan.tables.data_ptr()
        s.lens, s.rows = plan.lens.data_ptr(), plan.rows.data_ptr()
        s.table_stride, s.split = plan.tables.stride(0), plan.split
        s.block_size, s.v_off = meta.block_size, kv.stride(0)
        s.tiles = int(meta.num_requests >= self.tile_requests)
        slots = None
        if lora is not None:
            self.lora_steps += 1
            slots = lora.slots.contiguous()
        s.lora_slots = 0 if slots is None else slots.data_ptr()
        fn(*self._args)
        return out

    def _fp8_fn(self, kv_dtype: torch.dtype) -> Any:
        """The stack built for a float8 KV cache of ``kv_dtype`` (``kv_fp8.h``), or None."""
        if kv_dtype not in self._fp8_fns:
            code = KV_CODES.get(kv_dtype)
            self._fp8_fns[kv_dtype] = None if code is None else _load(self.dtype, code)
        return self._fp8_fns[kv_dtype]

    def _point_at(self, kv_caches: list[torch.Tensor]) -> None:
        """Each layer's KV cache (re-read if the caches moved)."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs != self._caches:
            if len(ptrs) != self.num_layers or any(c.dtype != kv_caches[0].dtype or
                                                   not c.is_contiguous() for c in kv_caches):
                raise ValueError("the KV caches do not match the model's layers")
            for w, ptr in zip(self.layers, ptrs, strict=True):
                w.kv = ptr
            self._caches, self._cache_tensors = ptrs, list(kv_caches)


class CpuStack(StepPath):
    """Decode steps through every layer in one C++ call (the module doc says which)."""

    name = "cpu_stack"
    phases = (DECODE,)

    @classmethod
    def why_not(cls, ctx: PathContext) -> str | None:
        if ctx.device_type != "cpu":
            return "not on the CPU"
        if ctx.tp is not None:
            return "rank 0's shard runs with the workers' collectives (tensor_parallel)"
        return DecodeStack.why_not(ctx.model)

    def __init__(self, ctx: PathContext) -> None:
        super().__init__(ctx)
        stack = DecodeStack.for_model(ctx.model)
        if stack is None:
            raise ValueError(f"cpu_stack: {DecodeStack.why_not(ctx.model)}")
        self.stack = stack

    def forward(self, inputs: Any, last_sampled: torch.Tensor | None) -> torch.Tensor | None:
        if inputs.num_tokens >= self.stack.max_rows:
            return None
        r = self.runner
        model = r.model
        begin(inputs, last_sampled, r.attn_backend)
        h = model.embed(inputs.input_ids)
        tables = model.rope_tables(inputs.positions, h.dtype)
        lora = None if model.lora is None else model.lora.step
        return self.stack.run(h, tables, r.kv_caches, inputs.attn_metadata, r.attn_backend,
                              lora)

    def describe(self) -> str:
        kind = " + ".join(self.stack.formats)
        return (f"cpu_stack ({kind}, {str(self.stack.dtype).removeprefix('torch.')}, "
                f"below {self.stack.max_rows} tokens)")
