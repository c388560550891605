"""A model's layers as the decode stack's structs (``kernels/stack_layout.h``), read off the
modules the per-layer path runs (``models/decoder.py``) and its family description
(``ModelSpec``): each norm with its offset, per-head q / k norms, Gemma's sandwich norms,
each projection in its weight format (``stack_formats.py``), the layer's RoPE table, window
and soft cap, the MLP's activation, or a mixture's router, experts and shared expert."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from asyncengine.executor.paths import stack_formats, stack_layout
from asyncengine.executor.paths.stack_layout import AeLayer, AeModel

ROPES = stack_layout.CONSTS["AE_STACK_ROPES"]
_ATTN = (("qkv", "qkv_proj"), ("o", "o_proj"))
_MLP = (("gate_up", "gate_up_proj"), ("down", "down_proj"))
_NORMS = (("in_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
          ("pre_ff_norm", "pre_feedforward_layernorm"),
          ("post_ff_norm", "post_feedforward_layernorm"))


def projections(layer: Any) -> Iterator[tuple[str, Any]]:
    """(AeLayer field, module) of each projection of ``layer``: attention's, the dense MLP's
    or a mixture's shared expert's."""
    for field, name in _ATTN:
        yield field, getattr(layer.self_attn, name)
    mlp = _dense_mlp(layer)
    if mlp is not None:
        for field, name in _MLP:
            yield field, getattr(mlp, name)


def _dense_mlp(layer: Any) -> Any:
    mlp = layer.mlp
    return mlp if _experts(layer) is None else mlp.shared_expert


def _experts(layer: Any) -> Any:
    """The layer's SparseMoE (``models/moe.py``), or None for a dense MLP."""
    return layer.mlp if hasattr(layer.mlp, "kernel_weights") else None


def _norms(layer: Any) -> Iterator[tuple[Any, Any]]:
    """(AeNorm field name, RMSNorm) of the layer's norms."""
    for field, name in _NORMS:
        if hasattr(layer, name):
            yield field, getattr(layer, name)
    if layer.self_attn.qk_norm:
        yield "q_norm", layer.self_attn.q_norm
        yield "k_norm", layer.self_attn.k_norm


def why_not(model: Any, dtype: torch.dtype) -> str | None:
    """None when every layer of ``model`` is one the stack computes as the per-layer path
    does for ``dtype`` activations, else why not."""
    from asyncengine.executor.models import moe

    spec = model.spec
    if spec.activation not in ("silu", "gelu_tanh"):
        return f"the {spec.activation} activation"
    if len(spec.ropes) > ROPES:
        return f"more than {ROPES} RoPE tables"
    for layer in model.model.layers:
        for _, lin in projections(layer):
            why = stack_formats.why_not(lin, dtype)
            if why is not None:
                return f"its projections are not all int4 or GGUF blocks kept packed ({why})"
        norms = [n.weight for _, n in _norms(layer)] + [model.model.norm.weight]
        if any(w.dtype != dtype or w.device.type != "cpu" or not w.is_contiguous()
               for w in norms):
            return "its norms are not in the activations' dtype on the CPU"
        experts = _experts(layer)
        if experts is not None:
            probe = torch.empty(0, dtype=dtype)
            if not experts._use_kernel(probe) or moe.route_kernel(dtype) is None:
                return "its experts do not take the C++ kernel (moe.cpp)"
    return None


class StackModel:
    """The structs of ``model``'s layers for ``dtype`` activations (what they point at kept
    alive here), with what the Python side needs to know of them."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        spec = model.spec
        self._pointed: list[torch.Tensor] = []
        self.ropes = list(dict.fromkeys(layer.rope for layer in spec.layers))
        m = self.model = AeModel()
        m.num_layers, m.elem_size = model.num_layers, torch.empty(0, dtype=dtype).element_size()
        m.hidden, m.heads, m.kv_heads = model.hidden_size, model.num_heads, model.num_kv_heads
        m.head_dim, m.rotary_dim = model.head_dim, spec.rotary_dim
        m.gelu, m.sandwich = int(spec.activation == "gelu_tanh"), int(spec.sandwich_norms)
        m.eps = float(model.model.norm.eps)
        self._norm(m.final_norm, model.model.norm)
        self.layers = (AeLayer * model.num_layers)()
        self.formats: set[type[stack_formats.Format]] = set()
        self.max_rows = 1 << 62  # fewer tokens: every projection's module keeps to its kernel
        self.tile_requests = 1 << 62  # from this many requests, int4's byte tiles
        for layer, lspec, w in zip(model.model.layers, spec.layers, self.layers, strict=True):
            for field, norm in _norms(layer):
                self._norm(getattr(w, field), norm)
            for field, lin in projections(layer):
                fmt = stack_formats.fill(getattr(w, field), lin, dtype, self.point)
                self.formats.add(fmt)
                self.max_rows = min(self.max_rows, fmt.max_rows(lin, dtype))
                self.tile_requests = min(self.tile_requests,
                                         fmt.tile_requests(lin, dtype) or 1 << 62)
            m.intermediate = max(m.intermediate, w.gate_up.n // 2)
            attn = layer.self_attn
            w.rope, w.scale = self.ropes.index(lspec.rope), float(attn.scale)
            w.window, w.soft_cap = attn.options.window or 0, attn.options.soft_cap or 0.0
            experts = _experts(layer)
            if experts is not None:
                self._experts(m, w, experts, dtype)
        m.layers = stack_layout.address(self.layers)

    def point(self, t: torch.Tensor) -> int:
        """``t``'s address, ``t`` kept alive with the structs."""
        self._pointed.append(t)
        return t.data_ptr()

    def _norm(self, n: Any, norm: Any) -> None:
        n.w, n.offset = self.point(norm.weight), float(norm.offset)

    def _experts(self, m: Any, w: Any, experts: Any, dtype: torch.dtype) -> None:
        w13, s13, w2, s2, kind, g13, g2 = experts.kernel_weights()
        m.experts, m.top_k, m.expert_inter = (experts.num_experts, experts.top_k,
                                              experts.intermediate)
        m.renormalize, m.expert_kind, m.g13, m.g2 = int(experts.renormalize), kind, g13, g2
        w.router = self.point(experts.router.to(dtype).contiguous())
        w.w13, w.s13, w.w2, w.s2 = (self.point(t.contiguous()) for t in (w13, s13, w2, s2))
        if experts.shared_expert is not None:
            w.shared_gate = self.point(experts.shared_expert_gate.to(dtype).contiguous())

    @property
    def format_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in stack_formats.FORMATS if f in self.formats)
