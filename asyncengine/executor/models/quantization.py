"""Weight-only int8 quantization (``--quantization int8``), applied once the weights are loaded.

Every linear layer of the decoder and the logits head (the tied embedding's copy of it: the
embedding lookup itself stays exact) gets symmetric per-output-channel int8 weights,
``w[n, k] ~= q[n, k] * scale[n]`` with ``q`` in [-127, 127].

Decoding a few requests streams all weights once per token, so a step costs what reading the
weights costs: int8 halves the bytes. PyTorch's CPU kernel ``torch._weight_int8pack_mm(x, q,
scales)`` multiplies bfloat16 activations by the int8 weights directly. Measured on a 2-core
AVX512-BF16 CPU (SmolLM2-135M, torch 2.13), it is the faster kernel up to ``INT8_MAX_ROWS``
rows: a decode step of 4 requests takes ~24 ms instead of ~33 ms; at one request it only
matches bfloat16 (~18 ms: this kernel reads int8 at ~14 GB/s, ATen's bfloat16 one at ~23 GB/s,
see ``small_matmul.py``); from 5 rows on it is slower, and from 8 rows at least twice as slow
(a step is compute-bound there). Larger batches therefore multiply by the dequantized weights
``q * scale`` kept in the model dtype: every batch size computes with the same int8 model, at
the price of holding both forms (1.5x the weight memory). float32 models (and other devices)
always take the dequantized form: the int8 kernel is slower than float32 matmuls there.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.config import QUANTIZATIONS

logger = logging.getLogger(__name__)

# Up to this many rows the int8 kernel is faster than a bfloat16 matmul.
INT8_MAX_ROWS = 4
# The int8 kernel reads in_features in vectors: other widths crash it or give wrong sums.
_INT8_K_MULTIPLE = 32


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
    """The weights an int8 layer computes with: ``q * scales[:, None]`` in ``dtype``."""
    return (q.float() * scales.float()[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """``y = x @ dequant(q).T + bias``: int8 kernel for few rows, dequantized weights else."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        dtype = weight.dtype
        q, scales = quantize_int8(weight)
        # The kernel scales by model-dtype scales: round them first so both paths agree.
        scales = scales.to(dtype)
        self.out_features, self.in_features = q.shape
        self.use_kernel = (weight.device.type == "cpu" and dtype == torch.bfloat16
                           and self.in_features % _INT8_K_MULTIPLE == 0)
        self.register_buffer("qweight", q if self.use_kernel else None)
        self.register_buffer("scales", scales)
        self.register_buffer("weight", dequantize_int8(q, scales, dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None and x.shape[0] <= INT8_MAX_ROWS:
            y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8_kernel={self.qweight is not None}")


def quantize_model(model: nn.Module, method: str,
                   grids: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
                   ) -> nn.Module:
    """Quantize ``model``'s linear layers in place (``method``: none, int8, int4).

    Linear layers are the built-in ``Linear`` and ``torch.nn.Linear`` modules. int8 also
    quantizes the logits head (a model with tied embeddings, ``lm_head is None``, gets an int8
    ``lm_head`` made from the embedding); int4 (``int4.py``) quantizes the decoder's linears
    and keeps the logits head in the model dtype. ``grids``: int4 grids by checkpoint weight
    name (a GGUF file's Q4 blocks) to keep those weights exactly as stored.
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"--quantization: invalid value {method!r} (allowed: "
                         f"{', '.join(QUANTIZATIONS)})")
    if method == "none":
        return model
    from asyncengine.executor.models.llama import Linear

    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, (Linear, nn.Linear))]
    if not targets:
        raise ValueError(f"--quantization {method}: {type(model).__name__} has no linear "
                         "layers to quantize")
    if method == "int4":
        return _quantize_int4(model, grids or {})
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child.weight.data, child.bias))
    if getattr(model, "lm_head", False) is None and getattr(model, "tie_word_embeddings", False):
        model.lm_head = Int8Linear(model.get_submodule("model.embed_tokens").weight.data)
    kernel = sum(m.qweight is not None for m in model.modules() if isinstance(m, Int8Linear))
    if not kernel:
        logger.warning("--quantization int8: no int8 kernel for %s weights on this device; "
                       "the model computes with the dequantized weights (no speed-up)",
                       str(next(m for m in model.modules()
                                if isinstance(m, Int8Linear)).weight.dtype))
    return model


def _quantize_int4(model: nn.Module, grids: dict[str, tuple[torch.Tensor, torch.Tensor]]
                   ) -> nn.Module:
    from asyncengine.executor.models.int4 import Int4Linear, supports_int4
    from asyncengine.executor.models.llama import FUSED_SHARDS, Linear

    shards: dict[str, list[str]] = {}
    for part, (fused, _) in FUSED_SHARDS.items():
        shards.setdefault(fused, []).append(part)
    exact = skipped = 0
    for qual, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, (Linear, nn.Linear)) or name == "lm_head":
                continue
            if not supports_int4(child.weight):
                skipped += 1
                continue
            prefix = f"{qual}." if qual else ""
            parts = [f"{prefix}{p}.weight" for p in shards.get(name, [name])]
            grid = None
            if all(p in grids for p in parts):
                grid = tuple(torch.cat([grids[p][i] for p in parts]) for i in (0, 1))
                exact += 1
            setattr(parent, name, Int4Linear(child.weight.data, child.bias, grid))
    logger.info("--quantization int4: %d linears packed (%d on the checkpoint's own Q4 grid), "
                "%d left unquantized (shapes the kernel does not take); the logits head stays "
                "unquantized", sum(isinstance(m, Int4Linear) for m in model.modules()), exact,
                skipped)
    return model


def weight_footprint(model: nn.Module) -> dict[str, float]:
    """MB of the model's parameters and buffers by kind (dtype; packed int4 as "int4")."""
    sizes: dict[str, float] = {}
    for mod in model.modules():
        for pname, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if t is None:
                continue
            kind = "int4" if pname == "packed" else str(t.dtype).removeprefix("torch.")
            sizes[kind] = sizes.get(kind, 0.0) + t.numel() * t.element_size() / 2**20
    return sizes
