"""Weight-only quantization (``--quantization``), applied once the weights are loaded.

- **int8**: every linear layer of the decoder and the logits head (the tied embedding's copy of
  it: the embedding lookup itself stays exact) gets symmetric int8 weights, per output channel
  from float weights (``w[n, k] ~= q[n, k] * scale[n]``, ``q`` in [-127, 127]) or per block of
  32 inputs as a GGUF file's Q8_0 stores them.
- **int4** (``int4.py``): the decoder's linears packed to 4 bits per block of 32 inputs (a
  GGUF's Q4_0 / Q4_1 kept as stored); the logits head int8 as above.
- **gguf** (``kquants.py``): a GGUF file's matrices kept exactly as stored, each in its own
  type (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, Q4_0, Q4_1, IQ4_XS, F16, BF16, F32), multiplied
  in place; the token embedding too (a lookup dequantizes the rows looked up).
- **auto** (the default): a GGUF file on the CPU runs packed as it is stored: only Q4_0 /
  Q4_1 / Q8_0 matrices as int4 / int8 where the packed kernels build, any other quantized
  type (a Q4_K_M file) as ``gguf``; a 4-bit AWQ or GPTQ checkpoint on the CPU as int4 on its
  own grid (``checkpoint_packed.int4_grid``); anything else as ``none``.

A GGUF file quantized to int4 / int8 (``install_gguf``) goes into its packed layers one layer
at a time as the file is read, never through the model's float linears; its token embedding
stays the file's blocks (``kquants.GGUFEmbedding``), and where it is tied to an int8 head on
its own Q8_0 grid, the lookups read the head's int8 rows (``Int8Embedding``): the vocabulary
is held once, and every value is the one the float model held.

Decoding a few requests streams all weights once per token, so a step costs what reading the
weights costs: int8 is a quarter of float32's bytes, int4 an eighth. The matmuls read the
packed weights directly (``executor/kernels/packed.py``); nothing is dequantized at load, and
where the kernels cannot be compiled the layers multiply by dequantized weights rebuilt per
call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.config import QUANTIZATIONS
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.weights.int4 import (
    BF16_ROWS,
    TILE_REQUESTS,
    Int4Linear,
    step_requests_or,
)

logger = logging.getLogger(__name__)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], float32 scales [out]) with
    ``weight ~= q * scales[:, None]``; a row of zeros gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights an int8 layer holds: ``q * scales`` (scales [out] or [out, blocks])."""
    s = scales.float()
    s = s[:, None] if s.dim() == 1 else s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    return (q.float() * s).to(dtype)


class Int8Linear(nn.Module):
    """``y = x @ (q * scales).T + bias`` from int8 weights (``packed_kernels.int8_mm``).

    ``grid``: (q int8 [out, in], scales float32 [out, in / 32]) as a GGUF file's Q8_0 stores
    them; else per-channel scales from ``weight``. ``float32_out``: the output stays float32
    whatever the input's dtype (the logits head: its kernel sums in float32 anyway, and
    rounding logits to bfloat16 makes near ids tie, so that greedy picks the lower id)."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
                 grid: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                 float32_out: bool = False) -> None:
        super().__init__()
        self.float32_out = float32_out
        if grid is None:
            assert weight is not None
            q, scales = quantize_int8(weight)
            scales = scales[:, None]
        else:
            q, scales = grid[0].to(torch.int8), grid[1].float()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.use_kernel = (q.device.type == "cpu" and packed_kernels.supports(
            self.in_features, self.in_features // scales.shape[1])
            and packed_kernels.available("int8"))
        # Few bfloat16 rows: ``int8_bf16.cpp`` (exact weights, one bf16 dot product per 32
        # weights a row, each row's result independent of the row count).
        self._bf16 = (self.use_kernel and scales.shape[1] in (1, self.in_features // 32)
                      and self.in_features % 64 == 0
                      and packed_kernels.bf16_available("int8_bf16"))
        # Steps of TILE_REQUESTS requests or more: byte tiles over activations rounded to int8
        # (``int8_tile8.cpp``, AVX-512 VNNI and BITALG), as Int4Linear's layers take them.
        self._tile8 = self._bf16 and packed_kernels.bf16_available("int8_tile8")

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        dtype = torch.float32 if self.float32_out else x.dtype
        if (self._bf16 and x2.dtype is torch.bfloat16 and x2.shape[0] < BF16_ROWS
                and not torch.compiler.is_compiling()):
            mm = (packed_kernels.int8_tile8_mm
                  if self._tile8 and step_requests_or(x2.shape[0]) >= TILE_REQUESTS
                  else packed_kernels.int8_bf16_mm)
            y = mm(x2, self.qweight, self.scales).to(dtype)
        elif self.use_kernel:
            y = packed_kernels.int8_linear(x2.float(), self.qweight, self.scales).to(dtype)
        else:
            y = F.linear(x2.to(dtype), self.dequantized(dtype))
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group={self.in_features // self.scales.shape[1]}, kernel={self.use_kernel}")


class Int8Embedding(nn.Module):
    """The token embedding of a model whose tied int8 head holds the GGUF file's Q8_0 blocks
    (``install_gguf``): a lookup reads the head's rows, ``q * scale`` in float32 (exactly the
    value the file's Q8_0 dequantizes to: an 11-bit float16 scale times a 7-bit integer),
    then the model's dtype. No second copy of the vocabulary."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", head.qweight)
        self.register_buffer("scales", head.scales)
        self.dtype = dtype
        self.num_embeddings, self.dim = head.qweight.shape
        self.block = self.dim // head.scales.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        n = flat.shape[0]
        q = self.qweight.index_select(0, flat).view(n, -1, self.block)
        rows = q * self.scales.index_select(0, flat).unsqueeze(2)  # float32, exact
        return rows.to(self.dtype).view(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, group={self.block}, dtype={self.dtype}"


def install_gguf(model: nn.Module, path: str, config: Any, method: str,
                 dtype: torch.dtype) -> set[str]:
    """A GGUF file's matrices straight into ``method``'s packed layers (int4 / int8, the
    logits head int8), each built as soon as the file has given its tensors: no float linear
    of the model is ever written (``quantize_model`` on the loaded model writes all of them
    first: an engine on the embedded SmolLM2's Q4_1 file held 5.4x the file's size that way,
    1.03x this way). The token embedding stays the file's blocks
    (``kquants.GGUFEmbedding``); a tied head is int8 on the embedding's Q8_0 grid, the
    embedding then reading the head's rows (``Int8Embedding``), or per output channel from the
    rows dequantized a slice at a time. Each layer is made from the weights rounded to
    ``dtype``, as the float model held them: the same layers as ``quantize_model`` makes.
    Returns the checkpoint names used; the caller loads the rest (norms, experts, the linears
    int4 cannot take) and calls ``quantize_model`` for what remains."""
    from asyncengine.executor.models.layers import FUSED_SHARDS, Embedding, Linear
    from asyncengine.executor.weights import kquants
    from asyncengine.executor.weights.gguf import hf_name, iter_gguf_tensors, read_packed
    from asyncengine.executor.weights.gguf_header import read_header
    from asyncengine.executor.weights.int4 import supports_int4

    header = read_header(path)
    arch = header.metadata.get("general.architecture", "llama")
    renames = getattr(getattr(model, "spec", None), "renames", ())

    def ours(name: str) -> str:
        for old, new in renames:
            name = name.replace(old, new)
        return name

    infos = {}  # our name -> (checkpoint name, tensor info)
    for t in header.tensors:
        if (name := hf_name(t.name, arch)) is not None:
            infos[ours(name)] = (name, t)
    used: set[str] = set()
    embed = infos.get("model.embed_tokens.weight")
    old = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and isinstance(old, Embedding):
        ckpt, t = embed
        block = kquants.TYPES.get(t.ggml_type, (None, 0))[1]
        if (block and len(t.dims) == 2 and t.dims[0] % block == 0
                and tuple(old.weight.shape) == (t.dims[1], t.dims[0])):
            packed = read_packed(path, config, only={ckpt})[ckpt]
            model.model.embed_tokens = kquants.GGUFEmbedding(packed.raw, packed.qtype,
                                                             packed.k, dtype)
            used.add(ckpt)
            if getattr(model, "lm_head", False) is None \
                    and getattr(model, "tie_word_embeddings", False):
                _tied_int8_head(model, packed.raw, packed.qtype, packed.k, dtype)

    owners = [q for q, m in model.named_modules() if hasattr(m, "load_checkpoint_tensor")]
    # prefix -> (parent, child, weights, biases (checkpoint names), grid names)
    plans: dict[str, tuple[nn.Module, str, list[str], list[str], list[str]]] = {}
    for qual, parent in list(model.named_modules()):
        if any(qual == o or qual.startswith(o + ".") for o in owners):
            continue  # a mixture's experts: loaded and quantized by their module
        for child_name, child in parent.named_children():
            if not isinstance(child, (Linear, nn.Linear)):
                continue
            prefix = f"{qual}.{child_name}" if qual else child_name
            if child_name == "lm_head" and qual:
                continue
            if child_name != "lm_head" and method == "int4" and not supports_int4(child.weight):
                continue  # stays float, as quantize_model leaves it
            shards = sorted(((part, shard) for part, (fused, shard) in FUSED_SHARDS.items()
                             if fused == child_name),
                            key=lambda ps: parent.shard_rows(ps[1])[0])
            if f"{prefix}.weight" in infos:
                names = [f"{prefix}.weight"]
            elif shards and all(f"{qual}.{p}.weight" in infos for p, _ in shards):
                names = [f"{qual}.{p}.weight" for p, _ in shards]
            else:
                continue
            tensors = [infos[n][1] for n in names]
            out_f, in_f = child.weight.shape
            if any(len(t.dims) != 2 or t.dims[0] != in_f for t in tensors) \
                    or sum(t.dims[1] for t in tensors) != out_f:
                continue  # the float load names the mismatch
            biases = [n.removesuffix("weight") + "bias" for n in names]
            if child.bias is None:
                biases = []
            elif not all(b in infos for b in biases):
                continue
            # the grids quantize_model looks up: by shard, so a projection the file stores
            # fused (Phi-3's attn_qkv, ffn_up) is quantized from its floats there too
            grid_names = [f"{qual}.{p}.weight" if qual else f"{p}.weight"
                          for p in _shards(child_name)]
            plans[prefix] = (parent, child_name, [infos[n][0] for n in names],
                             [infos[b][0] for b in biases], grid_names)
    want = {n: prefix for prefix, (_, _, ws, bs, _) in plans.items() for n in ws + bs}
    skip = {name for name, _ in infos.values() if name not in want}
    grids: dict[str, Any] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_gguf_tensors(path, config, grids, skip=skip):
        prefix = want.get(name)
        if prefix is None:
            continue
        parent, child_name, weights, biases, grid_names = plans[prefix]
        got = pending.setdefault(prefix, {})
        got[name] = tensor
        if len(got) < len(weights) + len(biases):
            continue
        del pending[prefix]
        w = torch.cat([got[n].to(dtype) for n in weights])
        bias = torch.cat([got[n].to(dtype) for n in biases]) if biases else None
        if child_name == "lm_head":
            layer: nn.Module = Int8Linear(w, bias, _q8_grid(grids, grid_names),
                                          float32_out=True)
        elif method == "int4":
            grid = None
            if all(n in grids and grids[n].kind == "q4" for n in grid_names):
                grid = tuple(torch.cat([torch.from_numpy(getattr(grids[n], f))
                                        for n in grid_names]) for f in ("scale", "other"))
            layer = Int4Linear(w, bias, grid)
        else:
            layer = Int8Linear(w, bias, _q8_grid(grids, grid_names))
        for n in weights:
            grids.pop(n, None)
        setattr(parent, child_name, layer)
        used.update(weights)  # a bias is a parameter of the layer: loaded again, in place
    return used


#: Vocabulary rows dequantized at a time for a tied int8 head off a non-Q8_0 embedding.
HEAD_ROWS = 8192


def _tied_int8_head(model: nn.Module, raw: torch.Tensor, qtype: int, k: int,
                    dtype: torch.dtype) -> None:
    """``model.lm_head`` as ``_quantize_head`` makes it from the float embedding, made from
    the embedding's GGUF blocks: the Q8_0 grid itself (and the embedding then reads the head:
    ``Int8Embedding``), else per output channel from the rows in ``dtype``."""
    from gguf import GGMLQuantizationType

    from asyncengine.executor.weights.gguf import quant_grid
    from asyncengine.executor.weights.kquants import dequantize_rows

    if qtype == GGMLQuantizationType.Q8_0:
        grid = quant_grid(raw.numpy(), GGMLQuantizationType.Q8_0)
        assert grid is not None
        head = Int8Linear(None, None, (torch.from_numpy(grid.other), torch.from_numpy(
            grid.scale)), float32_out=True)
        model.model.embed_tokens = Int8Embedding(head, dtype)
    else:
        vocab = raw.shape[0]
        q = torch.empty(vocab, k, dtype=torch.int8)
        scales = torch.empty(vocab, 1, dtype=torch.float32)
        for start in range(0, vocab, HEAD_ROWS):
            ids = torch.arange(start, min(start + HEAD_ROWS, vocab), dtype=torch.int64)
            q[start:start + len(ids)], s = quantize_int8(dequantize_rows(raw, qtype, k, ids,
                                                                         dtype))
            scales[start:start + len(ids), 0] = s
        head = Int8Linear(None, None, (q, scales), float32_out=True)
    model.lm_head = head


def resolve_auto(quantization: str, fmt: str, device: torch.device, qtypes: set[str],
                 checkpoint: Any = None) -> str:
    """What ``--quantization auto`` means for this model: ``int4`` for a GGUF file on the CPU
    whose linears are Q4_0 / Q4_1 (``qtypes``: the file's matrix types by name) when the
    packed kernels build, ``int8`` for one whose matrices are Q8_0; ``int4`` for a 4-bit AWQ
    or GPTQ checkpoint (``checkpoint``: its scheme) whose groups int4's blocks of 32 inputs
    tile; else ``none``."""
    if quantization == "gguf" and (fmt != "gguf" or device.type != "cpu"):
        raise ValueError("--quantization gguf: keeps a GGUF file's blocks as stored, for a "
                         ".gguf model on the CPU")
    if quantization != "auto":
        return quantization
    if device.type == "cpu" and fmt == "safetensors" and _int4_checkpoint(checkpoint) \
            and packed_kernels.available("int4") and packed_kernels.available("int8"):
        return "int4"
    if fmt != "gguf" or device.type != "cpu":
        return "none"
    if qtypes - {"Q4_0", "Q4_1", "Q8_0", "F32", "F16", "BF16"}:
        # k-quants (a Q4_K_M file's mix): packed as stored, each type multiplied in place (a
        # type the kernels lack is an error naming it; ``none`` dequantizes what gguf knows)
        return "gguf"
    if qtypes & {"Q4_0", "Q4_1"} and packed_kernels.available("int4"):
        return "int4" if packed_kernels.available("int8") else "none"
    if qtypes == {"Q8_0"} and packed_kernels.available("int8"):
        return "int8"
    return "none"


#: vLLM's ``--quantization`` names -> the checkpoint formats (``quant_method``) each means.
_VLLM_METHODS = {"awq": ("awq",), "awq_marlin": ("awq",), "gptq": ("gptq",),
                 "gptq_marlin": ("gptq",), "marlin": ("gptq",),
                 "fp8": ("fp8", "compressed-tensors", "fbgemm_fp8"),
                 "compressed-tensors": ("compressed-tensors",), "fbgemm_fp8": ("fbgemm_fp8",)}


def from_vllm_method(quantization: str, checkpoint: Any) -> str:
    """vLLM's name for a checkpoint's format (``--quantization awq`` for an AWQ checkpoint)
    read as ``auto``; a ValueError naming the flag when the checkpoint is not of that format
    (vLLM refuses the mismatch too; its ``fp8`` on float weights quantizes them at load,
    which asyncengine does not). Any other value as it is."""
    methods = _VLLM_METHODS.get(quantization)
    if methods is None:
        return quantization
    method = getattr(checkpoint, "method", None)
    if method in methods:
        return "auto"
    if method is None:
        extra = (" (quantizing float weights to FP8 at load is not supported; --quantization "
                 "int8 or int4 packs them on the CPU)") if quantization == "fp8" else ""
        raise ValueError(f"--quantization {quantization}: for checkpoints of that format, and "
                         f"the model's config has no quantization_config{extra}")
    raise ValueError(f"--quantization {quantization}: the model's quantization_config says "
                     f"{method!r}; pass --quantization auto (or {method})")


def _int4_checkpoint(scheme: Any) -> bool:
    """A 4-bit AWQ / GPTQ checkpoint whose every matrix fits int4's blocks: groups of a
    multiple of 32 inputs, in input order (GPTQ's act-order scatters them: dequantized)."""
    method = getattr(scheme, "method", None)
    if method == "awq":
        return scheme.group_size % 32 == 0
    if method == "gptq":
        return scheme.bits == 4 and not scheme.act_order and (
            scheme.group_size == -1 or scheme.group_size % 32 == 0)
    return False


def quantize_model(model: nn.Module, method: str, grids: dict[str, Any] | None = None
                   ) -> nn.Module:
    """Quantize ``model``'s linear layers in place (``method``: none, int8, int4).

    Linear layers are the built-in ``Linear`` and ``torch.nn.Linear`` modules. Both methods
    quantize the logits head to int8 (a model with tied embeddings, ``lm_head is None``, gets an
    int8 ``lm_head`` made from the embedding). ``grids``: a GGUF file's ``QuantGrid`` by
    checkpoint weight name, to keep those weights exactly as stored.
    """
    if method not in QUANTIZATIONS or method == "auto":
        raise ValueError(f"--quantization: invalid value {method!r} (allowed: "
                         f"{', '.join(QUANTIZATIONS)})")
    if method == "none":
        return model
    if method == "gguf":
        raise ValueError("--quantization gguf: applies while loading a GGUF file, not after")
    from asyncengine.executor.models.llama import Linear

    grids = grids or {}
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, (Linear, nn.Linear))]
    if not targets and not any(isinstance(m, (Int8Linear, Int4Linear))
                               for m in model.modules()):
        raise ValueError(f"--quantization {method}: {type(model).__name__} has no linear "
                         "layers to quantize")
    if method == "int4":
        _quantize_int4(model, grids)
    else:
        for qual, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, (Linear, nn.Linear)) and name != "lm_head":
                    prefix = f"{qual}." if qual else ""
                    grid = _q8_grid(grids, [f"{prefix}{p}.weight" for p in _shards(name)])
                    setattr(parent, name, Int8Linear(child.weight.data, child.bias, grid))
    for qual, module in model.named_modules():  # the experts of a mixture (``moe.py``)
        if hasattr(module, "quantize_experts"):
            prefix = f"{qual}."
            module.quantize_experts(method, {n[len(prefix):]: g for n, g in grids.items()
                                             if n.startswith(prefix)})
    _quantize_head(model, grids)
    if not any(m.use_kernel for m in model.modules() if isinstance(m, Int8Linear)):
        logger.warning("--quantization %s: the packed CPU kernels are not available here; the "
                       "model computes with dequantized weights (no speed-up)", method)
    return model


def _shards(name: str) -> list[str]:
    """The checkpoint names a fused built-in projection was loaded from (or ``name``)."""
    from asyncengine.executor.models.llama import FUSED_SHARDS

    parts = [part for part, (fused, _) in FUSED_SHARDS.items() if fused == name]
    return parts or [name]


def _q8_grid(grids: dict[str, Any], names: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not all(n in grids and grids[n].kind == "q8" for n in names):
        return None
    return (torch.cat([torch.from_numpy(grids[n].other) for n in names]),
            torch.cat([torch.from_numpy(grids[n].scale) for n in names]))


def _quantize_head(model: nn.Module, grids: dict[str, Any]) -> None:
    head = getattr(model, "lm_head", False)
    if head is None and getattr(model, "tie_word_embeddings", False):
        weight, bias, name = model.get_submodule("model.embed_tokens").weight, None, \
            "model.embed_tokens.weight"
    elif isinstance(head, nn.Module) and hasattr(head, "weight"):
        weight, bias, name = head.weight, getattr(head, "bias", None), "lm_head.weight"
    else:
        return
    model.lm_head = Int8Linear(weight.data, bias, _q8_grid(grids, [name]), float32_out=True)


def _quantize_int4(model: nn.Module, grids: dict[str, Any]) -> None:
    from asyncengine.executor.models.llama import Linear
    from asyncengine.executor.weights.int4 import supports_int4

    skipped = 0
    for qual, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, (Linear, nn.Linear)) or name == "lm_head":
                continue
            if not supports_int4(child.weight):
                skipped += 1
                continue
            prefix = f"{qual}." if qual else ""
            parts = [f"{prefix}{p}.weight" for p in _shards(name)]
            grid = None
            if all(p in grids and grids[p].kind == "q4" for p in parts):
                grid = tuple(torch.cat([torch.from_numpy(getattr(grids[p], f)) for p in parts])
                             for f in ("scale", "other"))
            setattr(parent, name, Int4Linear(child.weight.data, child.bias, grid))
    packed = [m for m in model.modules() if isinstance(m, Int4Linear)]
    logger.info("--quantization int4: %d linears packed (%d on the checkpoint's own Q4 grid), "
                "%d left unquantized (shapes the kernel does not take)",
                len(packed), sum(m.on_grid for m in packed), skipped)


def weight_footprint(model: nn.Module) -> dict[str, float]:
    """MB of the model's parameters and buffers by kind (dtype; packed int4 as "int4"), each
    storage counted once: a tied head reads the embedding's own bytes."""
    sizes: dict[str, float] = {}
    seen: set[tuple[str, int]] = set()
    for mod in model.modules():
        for pname, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() and key in seen:
                continue
            seen.add(key)
            kind = "int4" if pname == "packed" else str(t.dtype).removeprefix("torch.")
            sizes[kind] = sizes.get(kind, 0.0) + storage.nbytes() / 2**20
    return sizes
