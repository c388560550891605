"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), its experts as grouped
matmuls.

Per token the router picks ``top_k`` of ``num_experts`` gated MLPs::

    p = softmax(x @ router.T)                    # [T, E], in float32
    w, e = topk(p, k)                            # renormalized to sum 1 if ``renormalize``
    out = sum_j w_j * down_e_j(silu(gate_e_j(x)) * up_e_j(x))
        (+ sigmoid(x @ shared_gate.T) * shared_mlp(x))      Qwen2-MoE's shared expert

The ``T * k`` (token, expert) assignments are sorted by expert, so that each expert's tokens
form one contiguous group and every expert weight is read once per step: the experts of a
layer are one call of the C++ kernel ``kernels/moe.cpp`` (float32, int8 or packed int4
weights; bfloat16 ones with its AVX-512 tiles), or, where it cannot build, ``torch.nn.functional
.grouped_mm`` over the same groups. Nothing loops over tokens or experts in Python. Where
``moe.cpp`` runs, the routing (and the shared expert's gate) is one call of
``kernels/moe_route.cpp`` too, the kernel the C++ decode stack routes with.

Weights are stacked per expert: ``w13`` [E, 2 I, H] (gate rows, then up rows) and ``w2``
[E, H, I]. A checkpoint's per-expert tensors (``experts.3.gate_proj.weight``, Mixtral's
``w1 / w3 / w2``) or stacked ones (GGUF's ``ffn_gate_exps``, transformers' fused
``experts.gate_up_proj``) are copied into place by ``load_checkpoint_tensor``.
``--quantization int8 / int4`` packs the experts as the linear layers are packed
(``quantization.py``: the layouts of ``kernels/int8.cpp`` and ``kernels/int4.cpp``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.executor.kernels import build
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.kernels.where import host_kernel, on_host
from asyncengine.executor.models import moe_op
from asyncengine.executor.models.layers import MLP, Linear

if TYPE_CHECKING:
    from asyncengine.executor.models.family import ModelSpec

logger = logging.getLogger(__name__)

_ARGS = ("const float*", "const int64_t*", "const int64_t*", "const float*", "const uint8_t*",
         "const uint8_t*", "const uint8_t*", "const uint8_t*", "float*", "int64_t", "int64_t",
         "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t")
_KINDS = {"float32": 0, "int8": 1, "int4": 2, "bfloat16": 3}
_ROUTE_ARGS = ("const ae_t*", "const ae_t*", "const ae_t*", "int64_t*", "int64_t*", "float*",
               "ae_t*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t")
_warned: set[str] = set()


def kernel() -> object | None:
    """The compiled ``moe.cpp`` kernel, or None where it does not build."""
    return build.load("moe", _ARGS)


def route_kernel(dtype: torch.dtype) -> object | None:
    """The compiled ``moe_route.cpp`` for activations of ``dtype``, or None."""
    code = build.DTYPE_CODES.get(dtype)
    return None if code is None else build.load("moe_route", _ROUTE_ARGS, code)


@functools.cache
def wide_tiles() -> bool:
    """Whether the kernel has its AVX-512 tiles compiled in (float32 FMAs, int16 / byte dot
    products for int8 / int4 experts: ``kernels/moe512.h``); a call with no tokens asks."""
    k = kernel()
    if k is None:
        return False
    flag, none = torch.zeros(1), torch.zeros(2, dtype=torch.int64)
    k(flag, none, none, flag, none, none, none, none, flag, 0, 1, 1, 8, 8, 0, 0, 0)
    return bool(flag[0])


# checkpoint name of a per-expert projection -> (stack, which rows of it)
_EXPERT_PARTS = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1),
                 "w3": ("w13", 1), "down_proj": ("w2", None), "w2": ("w2", None)}


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer (``spec.moe``); input and output ``[T, hidden]``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        if spec.activation != "silu":
            raise ValueError(f"{spec.family}: experts with {spec.activation} are not supported")
        self.num_experts, self.top_k, self.renormalize = moe.num_experts, moe.top_k, \
            moe.renormalize
        self.hidden, self.intermediate = spec.hidden, moe.intermediate
        E, H, n_inter = moe.num_experts, spec.hidden, moe.intermediate
        self.router = nn.Parameter(torch.empty(E, H), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * n_inter, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, n_inter), requires_grad=False)
        self.quant = "float32"  # or int8 / int4 (``quantize_experts``)
        self.shared_expert: MLP | None = None
        if moe.shared_intermediate:
            self.shared_expert = MLP(H, moe.shared_intermediate)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, H), requires_grad=False)
        self._loaded: set[str] = set()
        self._op_key = moe_op.register(self)  # how a compiled trace calls this layer

    # -- loading -------------------------------------------------------------------------
    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor named relative to this module (``gate.weight``,
        ``experts.3.w1.weight``, ``experts.gate_up_proj``, ``shared_expert.up_proj.weight``)."""
        n_inter = self.intermediate
        parts = name.split(".")
        if name == "gate.weight":
            self._copy(self.router.data, tensor, name)
        elif name == "shared_expert_gate.weight" and self.shared_expert is not None:
            self._copy(self.shared_expert_gate.data, tensor.reshape(1, -1), name)
        elif parts[0] == "shared_expert" and self.shared_expert is not None:
            mlp, proj = self.shared_expert, parts[1]
            if proj in ("gate_proj", "up_proj"):
                start, size = mlp.shard_rows("gate" if proj == "gate_proj" else "up")
                self._copy(mlp.gate_up_proj.weight.data.narrow(0, start, size), tensor, name)
            else:
                self._copy(mlp.get_submodule(proj).weight.data, tensor, name)
        elif name == "experts.gate_up_proj":  # transformers' fused [E, 2 I, H]
            self._copy(self.w13.data, tensor, name, key=("w13", 0, None))
            self._loaded.add("w13/1/*")
        elif name == "experts.down_proj":
            self._copy(self.w2.data, tensor, name, key=("w2", None, None))
        elif len(parts) == 3 and parts[0] == "experts" and parts[1] in _EXPERT_PARTS:
            stack, half = _EXPERT_PARTS[parts[1]]  # GGUF's stacked [E, rows, cols]
            dest = getattr(self, stack).data
            part = dest if half is None else dest.narrow(1, half * n_inter, n_inter)
            self._copy(part, tensor, name, key=(stack, half, None))
        elif len(parts) == 4 and parts[0] == "experts" and parts[2] in _EXPERT_PARTS:
            e = int(parts[1])
            stack, half = _EXPERT_PARTS[parts[2]]
            dest = getattr(self, stack).data[e]
            part = dest if half is None else dest.narrow(0, half * n_inter, n_inter)
            self._copy(part, tensor, name, key=(stack, half, e))
        else:
            logger.warning("ignoring checkpoint tensor %s of a mixture-of-experts layer", name)

    def _copy(self, dest: torch.Tensor, tensor: torch.Tensor, name: str,
              key: tuple[str, int | None, int | None] | None = None) -> None:
        if tensor.shape != dest.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the "
                             f"model expects {tuple(dest.shape)}")
        dest.copy_(tensor)
        if key is None:
            self._loaded.add(name)
        else:
            stack, half, e = key
            self._loaded.add(f"{stack}/{half}/{'*' if e is None else e}")

    def missing_weights(self) -> list[str]:
        want = ["gate.weight"]
        if self.shared_expert is not None:
            want += ["shared_expert_gate.weight"]
        missing = [n for n in want if n not in self._loaded]
        for stack, halves in (("w13", (0, 1)), ("w2", (None,))):
            for half in halves:
                if f"{stack}/{half}/*" in self._loaded:
                    continue
                lost = [e for e in range(self.num_experts)
                        if f"{stack}/{half}/{e}" not in self._loaded]
                if lost:
                    what = {("w13", 0): "gate_proj", ("w13", 1): "up_proj"}.get(
                        (stack, half), "down_proj")
                    missing.append(f"experts.{lost[0]}.{what}.weight")
        if self.shared_expert is not None:  # (a GGUF file's blocks kept packed: installed)
            mlp = self.shared_expert
            of = {"gate_proj": mlp.gate_up_proj, "up_proj": mlp.gate_up_proj,
                  "down_proj": mlp.down_proj}
            missing += [f"shared_expert.{n}.weight" for n in of
                        if f"shared_expert.{n}.weight" not in self._loaded
                        and isinstance(of[n], Linear)]
        return missing

    # -- quantization --------------------------------------------------------------------
    @torch.no_grad()
    def quantize_experts(self, method: str, grids: dict[str, Any] | None = None) -> None:
        """Pack the experts as ``--quantization int8 / int4`` packs linear layers: int8 per
        output channel, int4 per block of 32 inputs (scale, min) (``int4.py``). ``grids``: a
        GGUF file's ``QuantGrid`` by checkpoint name relative to this module
        (``experts.gate_proj.weight``): Q8_0 experts (int8) or Q4_0 / Q4_1 ones (int4) are
        kept exactly as the file stores them, int8 with its scale per block of 32."""
        if method not in ("int8", "int4") or self.quant != "float32":
            return
        from asyncengine.executor.weights.int4 import quantize_int4

        if method == "int4" and not (packed_kernels.supports(self.hidden)
                                     and packed_kernels.supports(self.intermediate)):
            logger.info("--quantization int4: experts of %dx%d left as they are (inputs must "
                        "be multiples of 32)", self.hidden, self.intermediate)
            return
        for name in ("w13", "w2"):
            w = getattr(self, name).data.float()
            E, N, K = w.shape
            grid = self._file_grid(name, grids or {}, "q8" if method == "int8" else "q4")
            if method == "int8" and grid is not None:  # the file's Q8_0 blocks
                packed, scale = grid[1].to(torch.int8), grid[0].float()
            elif method == "int8":  # per output channel, as int8.quantize_int8
                amax = w.abs().amax(dim=2, keepdim=True)
                scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
                packed = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
            else:
                flat = None if grid is None else tuple(g.reshape(E * N, K // 32) for g in grid)
                q, s, mn = quantize_int4(w.reshape(E * N, K), flat)
                packed = packed_kernels.pack_int4(q).view(E, N, K // 2)
                scale = torch.stack([s, mn], dim=-1).view(E, N, K // 32, 2)
            delattr(self, name)
            self.register_buffer(name, packed.contiguous())
            self.register_buffer(f"{name}_scale", scale.contiguous())
        self.quant = method

    def _file_grid(self, name: str, grids: dict[str, Any], kind: str
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(scale, other) of stack ``name`` (w13: gate rows then up rows; w2) as [E, N, ...]
        from the file's grids of kind ``kind``, or None unless every part has one."""
        parts = ["gate_proj", "up_proj"] if name == "w13" else ["down_proj"]
        found = [grids.get(f"experts.{p}.weight") for p in parts]
        if not all(g is not None and g.kind == kind for g in found):
            return None
        E = self.num_experts
        return tuple(torch.cat([torch.from_numpy(getattr(g, f)).reshape(E, -1, *getattr(
            g, f).shape[1:]) for g in found], dim=1) for f in ("scale", "other"))

    def dequantized(self, name: str, experts: torch.Tensor | None = None) -> torch.Tensor:
        """Expert weights ``name`` (w13, w2) as float32 [E', N, K] (``experts``: which)."""
        w = getattr(self, name)
        if experts is not None:
            w = w[experts]
        if self.quant == "float32":
            return w.float()
        s = getattr(self, f"{name}_scale")
        s = s if experts is None else s[experts]
        if self.quant == "int8":  # a scale per row, or per block of 32 (Q8_0)
            return w.float() * s.float().repeat_interleave(w.shape[-1] // s.shape[-1], dim=-1)
        q = packed_kernels.unpack_int4(w.reshape(-1, w.shape[-1])).float()
        E, N = w.shape[:2]
        K = q.shape[1]
        sm = s.float().reshape(E * N, K // 32, 2)
        q = q.view(E * N, K // 32, 32) * sm[..., :1] + sm[..., 1:]
        return q.view(E, N, K)

    # -- forward -------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], experts int64 [T, k]) for ``x`` [T, hidden]."""
        logits = F.linear(x, self.router.to(x.dtype))
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in the trace (moe_op.py)
            return torch.ops.asyncengine.moe_layer(x, self._op_key)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` outside a trace: the experts' rows as the router gives them."""
        T = x.shape[0]
        gate = None
        use_kernel = self._use_kernel(x)
        route = route_kernel(x.dtype) if use_kernel else None
        if route is not None:
            rows, offs, wts, gate = self._route_cpu(route, x)
            out = self._kernel(x, rows, offs, wts)
        else:
            weights, experts = self.route(x)
            flat = experts.reshape(-1)
            order = torch.argsort(flat, stable=True)  # assignments sorted by expert
            counts = torch.bincount(flat, minlength=self.num_experts)
            if use_kernel:
                offs = torch.zeros(self.num_experts + 1, dtype=torch.int64)
                torch.cumsum(counts, 0, out=offs[1:])
                out = self._kernel(x, order // self.top_k, offs, weights.reshape(-1)[order])
            else:
                out = self._grouped(x, weights, order, counts)
        out = out.to(x.dtype)
        if self.shared_expert is not None:
            if gate is None:
                gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.to(x.dtype)))
            out = out + gate * self.shared_expert(x)
        return out.view(T, self.hidden)

    def _route_cpu(self, route: Any, x: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``moe_route.cpp``'s routing of ``x``: each assignment's token (sorted by expert),
        where each expert's start, their weights; the shared expert's gate [T, 1] (or None)."""
        T, k = x.shape[0], self.top_k
        x = x.contiguous()
        rows = torch.empty(T * k, dtype=torch.int64)
        offs = torch.empty(self.num_experts + 1, dtype=torch.int64)
        wts = torch.empty(T * k, dtype=torch.float32)
        shared = self.shared_expert is not None
        gate = torch.empty(T, 1, dtype=x.dtype)
        route(x, self.router.to(x.dtype).contiguous(),
              self.shared_expert_gate.to(x.dtype).contiguous() if shared else x, rows, offs,
              wts, gate, T, self.hidden, self.num_experts, k, int(self.renormalize),
              int(shared))
        return rows, offs, wts, gate if shared else None

    def _use_kernel(self, x: torch.Tensor) -> bool:
        ok = (host_kernel(x)
              and (self.quant != "float32" or self.w13.dtype == torch.float32
                   or (self.w13.dtype == torch.bfloat16 and wide_tiles()))
              and self.hidden % 8 == 0 and self.intermediate % 8 == 0)
        if ok and kernel() is None:
            ok = False
        if not ok and on_host(x) and "moe" not in _warned:
            _warned.add("moe")
            logger.info("mixture of experts: the C++ kernel does not take this layer (%s "
                        "weights, %s); torch's grouped_mm runs instead", self.w13.dtype,
                        "no compiler" if kernel() is None else "shape")
        return ok

    def _kernel(self, x: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor,
                wts: torch.Tensor) -> torch.Tensor:
        """``moe.cpp`` over the assignments sorted by expert: ``rows`` their tokens, ``offs``
        [E + 1] where each expert's start, ``wts`` their weights."""
        T, k = x.shape[0], self.top_k
        out = torch.empty(T, self.hidden, dtype=torch.float32)
        w13, s13, w2, s2, kind, g13, g2 = self.kernel_weights()
        kernel()(x.float().contiguous(), rows, offs, wts, w13, s13, w2, s2, out, T, k,
                 self.num_experts, self.hidden, self.intermediate, kind, g13, g2)
        return out

    def kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      int, int, int]:
        """``moe.cpp``'s weight arguments: w13, its scales, w2, its scales (a float expert's:
        its weights again), the kind, and int8's group sizes of w13 and w2."""
        s13 = getattr(self, "w13_scale", self.w13)
        s2 = getattr(self, "w2_scale", self.w2)
        g13 = self.hidden // s13.shape[-1] if self.quant == "int8" else 0
        g2 = self.intermediate // s2.shape[-1] if self.quant == "int8" else 0
        kind = _KINDS["bfloat16" if self.w13.dtype == torch.bfloat16 else self.quant]
        return self.w13, s13, self.w2, s2, kind, g13, g2

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """The same groups through ``F.grouped_mm`` (the active experts' weights only)."""
        T, k = weights.shape
        active = torch.nonzero(counts).view(-1)
        offs = torch.cumsum(counts[active], 0).to(torch.int32)
        dtype = x.dtype if self.quant == "float32" else torch.float32
        xs = x[order // k].to(dtype)
        w13 = self.dequantized("w13", active).to(dtype)
        w2 = self.dequantized("w2", active).to(dtype)
        h = F.grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = F.grouped_mm((F.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offs)
        y = y.float() * weights.reshape(-1)[order, None]
        out = torch.zeros(T, self.hidden, dtype=torch.float32)
        return out.index_add_(0, order // k, y)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, renormalize={self.renormalize}, "
                f"weights={self.quant}")
