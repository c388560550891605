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

A GGUF file quantized to int4 / int8 (``gguf_quantized.install_gguf``) goes into its packed
layers one layer at a time as the file is read, never through the model's float linears; its
token embedding stays the file's blocks (``kquants.GGUFEmbedding``), and where it is tied to
an int8 head on its own Q8_0 grid, the lookups read the head's int8 rows (``Int8Embedding``,
``int8.py``): the vocabulary is held once, and every value is the one the float model held.

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
from torch import nn

from asyncengine.config import QUANTIZATIONS
from asyncengine.executor.kernels import packed as packed_kernels
from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.weights.int4 import Int4Linear
from asyncengine.executor.weights.int8 import Int8Linear

logger = logging.getLogger(__name__)


def resolve_auto(quantization: str, fmt: str, device: torch.device, qtypes: set[str],
                 checkpoint: Any = None) -> str:
    """What ``--quantization auto`` means for this model: ``int4`` for a GGUF file on the CPU
    whose linears are Q4_0 / Q4_1 (``qtypes``: the file's matrix types by name) when the
    packed kernels build, ``int8`` for one whose matrices are Q8_0; ``int4`` for a 4-bit AWQ
    or GPTQ checkpoint (``checkpoint``: its scheme) whose groups int4's blocks of 32 inputs
    tile; else ``none``."""
    if quantization == "gguf" and (fmt != "gguf" or not on_host(device)):
        raise ValueError("--quantization gguf: keeps a GGUF file's blocks as stored, for a "
                         ".gguf model on the CPU")
    if quantization != "auto":
        return quantization
    if on_host(device) and fmt == "safetensors" and _int4_checkpoint(checkpoint) \
            and packed_kernels.available("int4") and packed_kernels.available("int8"):
        return "int4"
    if fmt != "gguf" or not on_host(device):
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
                    grid = q8_grid(grids, [f"{prefix}{p}.weight" for p in checkpoint_shards(name)])
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


def checkpoint_shards(name: str) -> list[str]:
    """The checkpoint names a fused built-in projection was loaded from (or ``name``)."""
    from asyncengine.executor.models.llama import FUSED_SHARDS

    parts = [part for part, (fused, _) in FUSED_SHARDS.items() if fused == name]
    return parts or [name]


def q8_grid(grids: dict[str, Any], names: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
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
    model.lm_head = Int8Linear(weight.data, bias, q8_grid(grids, [name]), float32_out=True)


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
            parts = [f"{prefix}{p}.weight" for p in checkpoint_shards(name)]
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
