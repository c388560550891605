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
(``TorchPagedBackend.decode_plan``), with fewer than ``DEQUANT_ROWS`` tokens (the int4 kernel's
own range), for a model of the plain Llama layout (``ModelSpec.lacks``) whose projections are
all int4 without bias: the default for the embedded Q4_1 GGUF and for ``--quantization int4``
(in bfloat16 through Int4Linear's bfloat16 kernel, where it runs, and, for steps of
``int4.TILE_REQUESTS`` requests or more, its byte tiles, as Int4Linear takes them). Or,
``kernels/decode_stack_kq.cpp``, whose projections are all ``GGUFLinear`` (a GGUF file kept
packed, ``--quantization gguf``: Q4_K_M's mix of types, a fused projection's parts in their own
types, Qwen2's q/k/v bias), with fewer than ``kquants.TILE_ROWS`` tokens (the packed kernel's
range; from there GGUFLinear multiplies dequantized tiles), or, a bfloat16 model where the
kernel multiplies those tiles itself (``kquants.fused_tiles``), up to ``kquants.FUSED_ROWS``.
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
from asyncengine.executor.paths import stack_layout
from asyncengine.executor.paths.base import DECODE, PathContext, StepPath, begin
from asyncengine.executor.paths.stack_layout import AeLayer, AeModel, AeStep
from asyncengine.executor.weights import kquants
from asyncengine.executor.weights.int4 import DEQUANT_ROWS, TILE_REQUESTS, Int4Linear

# the addresses of the model's and the step's structs of kernels/stack_layout.h
# (``stack_layout.py``); or 0, 0 and where to write their layout
_ARGS = ("uintptr_t", "uintptr_t", "uintptr_t")
_PARTS = stack_layout.CONSTS["AE_STACK_PARTS"]
_W_INT4, _W_GGUF = stack_layout.CONSTS["AE_W_INT4"], stack_layout.CONSTS["AE_W_GGUF"]


@functools.cache
def _load(name: str, dtype: torch.dtype, kv_code: int = 0) -> Any:
    """The compiled stack ``name`` for activations of ``dtype`` and that KV cache, its struct
    layout checked against ``stack_layout.py``'s (None where it does not build)."""
    fn = load(name, _ARGS, DTYPE_CODES[dtype], kv_code=kv_code)
    if fn is not None:
        stack_layout.check(fn)
    return fn


class DecodeStack:
    """The model's layers as the structs of ``kernels/stack_layout.h``, for
    ``decode_stack.cpp``."""

    def __init__(self, model: Any, fn: Any, kquant: bool = False,
                 dtype: torch.dtype = torch.float32, tiles: bool = False) -> None:
        self.fn = fn
        self._fp8_fns: dict[torch.dtype, Any] = {}  # the stack for a float8 KV cache
        self.kquant = kquant
        self.dtype = dtype  # of the activations and norms (and the KV cache, but float8)
        # the most tokens a step may have: the matmul kernels' packed range
        # (a bfloat16 GGUF model where the kernel multiplies bfloat16 tiles: up to FUSED_ROWS)
        self.max_rows = DEQUANT_ROWS if not kquant else (
            kquants.FUSED_ROWS + 1 if kquants.fused_tiles(dtype) else kquants.TILE_ROWS)
        # int4 in bfloat16: from this many requests a step's matmuls take the byte tiles
        # (never, where they are not compiled in: Int4Linear then keeps the row kernel)
        self.tile_requests = TILE_REQUESTS if tiles else 1 << 62
        self.num_layers = model.num_layers
        self.rope = model.spec.layers[0].rope  # the one RoPE table of the Llama layout
        self.num_kv_heads, self.hidden = model.num_kv_heads, model.hidden_size
        self._pointed: list[torch.Tensor] = []  # what the structs point at, kept alive
        m = self.model = AeModel()
        m.num_layers, m.elem_size = model.num_layers, torch.empty(0, dtype=dtype).element_size()
        m.hidden, m.heads, m.kv_heads = model.hidden_size, model.num_heads, model.num_kv_heads
        m.head_dim, m.intermediate = model.head_dim, model.config.intermediate_size
        m.eps = float(model.model.norm.eps)
        m.final_norm.w = self._point(model.model.norm.weight)
        self.layers = (AeLayer * model.num_layers)()
        for layer, w in zip(model.model.layers, self.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            w.in_norm.w = self._point(layer.input_layernorm.weight)
            w.post_attn_norm.w = self._point(layer.post_attention_layernorm.weight)
            for name, lin in (("qkv", attn.qkv_proj), ("o", attn.o_proj),
                              ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
                self._proj(getattr(w, name), lin)
            w.scale = float(attn.scale)
        m.layers = stack_layout.address(self.layers)
        self.step = AeStep()
        self._args = (stack_layout.address(m), stack_layout.address(self.step), 0)
        self._caches: tuple[int, ...] = ()
        self._cache_tensors: list[torch.Tensor] = []
        # --enable-lora: the adapters' slot tables (``executor/lora/tables.py``), which each
        # projection's struct points at, so that steps with adapter rows stay in the stack
        self.lora_table: Any = None
        self.lora_steps = 0  # steps run with adapter rows
        tables = getattr(getattr(model, "lora", None), "tables", None)
        # GGUF, or int4 in bfloat16: steps with adapter rows go per layer
        if tables is not None and not kquant and dtype == torch.float32 and self._lora(tables):
            self.lora_table = tables

    def _point(self, t: torch.Tensor) -> int:
        self._pointed.append(t)
        return t.data_ptr()

    def _proj(self, p: Any, lin: Any) -> None:
        """``p`` (an AeProj) describes ``lin`` (int4 or GGUF blocks), as its forward takes
        ``self.dtype`` rows."""
        p.n, p.k = lin.out_features, lin.in_features
        if isinstance(lin, Int4Linear):
            p.kind = _W_INT4
            p.data[0], p.aux[0] = self._point(lin.packed), self._point(lin.scale_min)
            return
        p.kind = _W_GGUF
        if lin.bias is not None:
            p.bias = self._point(lin.bias)
        flag = lin.flag(self.dtype)  # each part's type with the flags its calls get
        p.parts = len(lin.qtypes)
        for i, (raw, qtype) in enumerate(lin.parts()):
            p.data[i], p.aux[i], p.rows[i] = self._point(raw), qtype | flag, raw.shape[0]

    def _lora(self, tables: Any) -> bool:
        """Each projection's LoRA slot tables, when every layer's four have them."""
        names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        found = [[tables.get(f"model.layers.{i}.{n}") for n in names]
                 for i in range(self.num_layers)]
        if any(t is None for row in found for t in row):
            return False
        for row, w in zip(found, self.layers, strict=True):
            for t, p in zip(row, (w.qkv, w.o, w.gate_up, w.down), strict=True):
                p.lora_a, p.lora_b = self._point(t.A), self._point(t.B)
                p.lora_rows, p.lora_span = self._point(t.rows), self._point(t.span)
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
        if "decode_stack" in spec.lacks():
            return spec.lacks()["decode_stack"]
        linears = _linears(model)
        kquant = all(_kq_ok(lin) for lin in linears)
        if not kquant and not all(isinstance(lin, Int4Linear) and lin._direct
                                  and lin.packed.is_contiguous()
                                  and lin.scale_min.is_contiguous() for lin in linears):
            return "its projections are not all int4 or GGUF blocks kept packed"
        # float32 or bfloat16 (a GGUF model's matmuls take float32 copies, as GGUFLinear's
        # do, biases included)
        # int4 in bfloat16: Int4Linear's bfloat16 kernel (AVX-512 BF16) for every projection
        dtype = model.model.norm.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return f"{str(dtype).removeprefix('torch.')} activations"
        if dtype == torch.bfloat16 and not kquant and not all(lin._bf16 for lin in linears):
            return "int4 in bfloat16 needs the CPU's AVX-512 BF16"
        for layer in model.model.layers:
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if kquant:
                tensors += [lin.bias for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                 layer.mlp.gate_up_proj, layer.mlp.down_proj)
                            if lin.bias is not None]
            if any(w.dtype != dtype or w.device.type != "cpu" for w in tensors):
                return "its norms or biases are not in the activations' dtype on the CPU"
        if _load("decode_stack_kq" if kquant else "decode_stack", dtype) is None:
            return "the C++ stack did not build"
        return None

    @classmethod
    def for_model(cls, model: Any) -> DecodeStack | None:
        """The stack for ``model``, or None where it does not apply (:meth:`why_not`)."""
        if cls.why_not(model) is not None:
            return None
        linears = _linears(model)
        kquant = all(_kq_ok(lin) for lin in linears)
        dtype = model.model.norm.weight.dtype
        fn = _load("decode_stack_kq" if kquant else "decode_stack", dtype)
        tiles = dtype == torch.bfloat16 and not kquant and all(lin._tile8 for lin in linears)
        return cls(model, fn, kquant, dtype, tiles)

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
        cos, sin = tables[self.rope]
        kv = kv_caches[0]
        fn = self.fn if kv.dtype == self.dtype else self._fp8_fn(kv.dtype)
        if fn is None or kv.stride(0) != kv_caches[-1].stride(0):
            return None
        self._point_at(kv_caches)
        h = h.contiguous()
        out = torch.empty(T, self.hidden, dtype=self.dtype)
        s = self.step
        s.h, s.out, s.tokens = h.data_ptr(), out.data_ptr(), T
        s.cos, s.sin = cos.data_ptr(), sin.data_ptr()
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
            self._fp8_fns[kv_dtype] = None if code is None else _load(
                "decode_stack_kq" if self.kquant else "decode_stack", self.dtype, code)
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


def _linears(model: Any) -> list[Any]:
    return [lin for layer in model.model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _kq_ok(lin: Any) -> bool:
    """Whether ``lin`` is a GGUFLinear that decode_stack_kq.cpp multiplies as GGUFLinear does:
    through its kernel, at most AE_STACK_PARTS parts, contiguous rows, a contiguous bias or
    none."""
    if not (isinstance(lin, kquants.GGUFLinear) and lin.use_kernel
            and len(lin.qtypes) <= _PARTS):
        return False
    bias = lin.bias
    if bias is not None and not bias.is_contiguous():
        return False
    return all(raw.is_contiguous() for raw, _ in lin.parts())


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
        kind = "GGUF blocks" if self.stack.kquant else "int4"
        return (f"cpu_stack ({kind}, {str(self.stack.dtype).removeprefix('torch.')}, "
                f"below {self.stack.max_rows} tokens)")
