"""Quantized safetensors checkpoints: the ``quantization_config`` of a model's config.json.

The FP8, AWQ and GPTQ checkpoints vLLM serves are read here. Their matrices are dequantized
once, as they are loaded, to the model's dtype; ``--quantization int8`` / ``int4`` can then
pack them as they would any float weights, and ``int4`` (the CPU's default for 4-bit AWQ and
GPTQ in input order) keeps a 4-bit matrix on its own grid (``checkpoint_packed.py``). AWQ
(``quant_method: awq``, ``version: gemm``, 4 bits, zero points: AutoAWQ's format) stores
``qweight`` (int32, ``[in, out / 8]``, eight 4-bit values a word in AWQ's column order),
``qzeros`` (the same packing, a row per group of ``group_size`` inputs) and ``scales`` (``[in /
group_size, out]``); ``W = (q - zero) * scale``. GPTQ (``quant_method: gptq``, 4 or 8 bits:
AutoGPTQ / GPTQModel) packs ``qweight`` along the inputs (``[in / per_word, out]``, plain
order) and ``qzeros`` along the outputs, stores ``zero - 1`` unless ``checkpoint_format`` is
``gptq_v2``, and under act-order (``desc_act``) ``g_idx`` gives each input row's group (without
it, row ``k``'s group is ``k // group_size``); ``W = (q - zero[g_idx]) * scale[g_idx]``. Three
FP8 formats are read:

* ``compressed-tensors`` with float 8-bit weights (``format: float-quantized``, the
  llm-compressor / RedHatAI FP8 models): ``W = weight * weight_scale``, where the scale is per
  tensor (shape ``[1]`` or ``[]``) or per output channel (``[out, 1]``);
* ``fp8`` (transformers' fine-grained FP8, DeepSeek-V3's format): a scale per block of
  ``weight_block_size`` (128 x 128), ``W = weight * weight_scale_inv`` block by block;
* ``fbgemm_fp8``: ``weight_scale`` per output channel.

For FP8, activation scales (``input_scale``) and the checkpoint's KV-cache scales (``k_scale``,
``v_scale``) are dropped, each family logged once: activations stay in the model's dtype, and
the KV cache is unscaled (``--kv-cache-dtype``). So the tokens are those of the dequantized
model (transformers on it gives the same), not those of FP8 matmuls. Any other
``quant_method``, or a compressed-tensors scheme that is not float 8-bit, is refused with a
``ValueError`` that names it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.executor.weights.checkpoint_packed import (
    AWQScheme,
    GPTQScheme,
    record,
    unpack_awq_matrix,
    unpack_gptq_matrix,
)

logger = logging.getLogger("asyncengine")

FP8_METHODS = ("compressed-tensors", "fp8", "fbgemm_fp8")
METHODS = (*FP8_METHODS, "awq", "gptq")
_AWQ_PARTS = ("qweight", "qzeros", "scales")  # GPTQ's too, and g_idx under act-order
_DROPPED = ("input_scale", "input_scale_ub", "k_scale", "v_scale", "kv_scale")


@dataclass(frozen=True)
class FP8Scheme:
    method: str
    #: ``fp8``'s block shape (rows, columns) of one scale; None: per tensor or per channel.
    block: tuple[int, int] | None = None

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"


def checkpoint_quantization(config: Any,
                            name: str) -> FP8Scheme | AWQScheme | GPTQScheme | None:
    """The scheme of ``config``'s ``quantization_config``, None without one. ValueError for
    what asyncengine cannot read."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower()
    supported = (f"supported: FP8 checkpoints ({', '.join(FP8_METHODS)}), AWQ (4-bit GEMM), "
                 "GPTQ (4 or 8 bits), GGUF files, and --quantization int8/int4 on float "
                 "weights")
    if method not in METHODS:
        raise ValueError(f"model {name!r}: its quantization_config has quant_method "
                         f"{method or '(none)'!r}, which asyncengine cannot load ({supported})")
    if method == "gptq":
        bits, group = qc.get("bits"), int(qc.get("group_size", 128))
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2") or group == 0 or group < -1:
            raise ValueError(f"model {name!r}: a GPTQ checkpoint of {bits} bits, format "
                             f"{fmt!r}, group {group}; asyncengine reads 4- and 8-bit gptq / "
                             f"gptq_v2 checkpoints ({supported})")
        return GPTQScheme(bits, group, 0 if fmt == "gptq_v2" else 1, bool(qc.get("desc_act")))
    if method == "awq":
        bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if bits != 4 or version != "gemm" or not qc.get("zero_point", True) or group < 1:
            raise ValueError(f"model {name!r}: an AWQ checkpoint of {bits} bits, version "
                             f"{version!r}, zero_point {qc.get('zero_point', True)}, group "
                             f"{group}; asyncengine reads 4-bit GEMM checkpoints with zero "
                             f"points ({supported})")
        return AWQScheme(group)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None or len(block) != 2:
            raise ValueError(f"model {name!r}: an fp8 quantization_config without a "
                             f"weight_block_size of two numbers ({block!r})")
        return FP8Scheme(method, (int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        weights = [g.get("weights") or {} for g in groups.values()]
        bad = [w for w in weights if w.get("type") != "float" or w.get("num_bits") != 8
               or w.get("strategy") not in ("tensor", "channel")]
        if fmt not in ("float-quantized", "naive-quantized") or not weights or bad:
            raise ValueError(
                f"model {name!r}: a compressed-tensors checkpoint of format {fmt!r} with "
                f"weights {bad[0] if bad else weights or 'of no group'}; asyncengine reads "
                f"its float 8-bit weights with a scale per tensor or per channel ({supported})")
    return FP8Scheme(method)


def dequantize(weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """``weight`` (float8) times its scale, in float32: a scale per tensor or per row, or
    one per ``block`` of ``weight`` (the last blocks of a side may be partial)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is None:
        return w * (s.reshape(-1, 1) if s.numel() == w.shape[0] and s.numel() > 1 else s)
    rows, cols = w.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(s.shape) != expected:
        raise ValueError(f"a block scale of shape {tuple(s.shape)} for a weight of "
                         f"{(rows, cols)} in blocks of {block}: expected {expected}")
    full = s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w * full


def dequantize_checkpoint(weights: Iterator[tuple[str, torch.Tensor]],
                          scheme: FP8Scheme | AWQScheme | GPTQScheme,
                          grids: dict[str, Any] | None = None,
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with its quantized matrices dequantized (float32).

    ``grids``: filled with each 4-bit AWQ / GPTQ matrix's own grid in int4's blocks of 32
    inputs (``int4_grid``), by weight name, for ``--quantization int4`` to pack the matrix as
    stored rather than quantize it again."""
    if isinstance(scheme, AWQScheme):
        def awq(name: str, p: dict[str, torch.Tensor]) -> torch.Tensor:
            q, zeros, s = unpack_awq_matrix(p["qweight"], p["qzeros"], p["scales"],
                                            scheme.group_size)
            g_idx = torch.arange(q.shape[0]) // scheme.group_size
            return record(name, q, zeros, s, g_idx, grids)

        return _announce(_gather(weights, _AWQ_PARTS, (), "AWQ", awq), scheme, grids)
    if isinstance(scheme, GPTQScheme):  # g_idx: each input row's group, under act-order only
        parts, dropped = (_AWQ_PARTS + ("g_idx",), ()) if scheme.act_order else \
            (_AWQ_PARTS, ("g_idx",))

        def gptq(name: str, p: dict[str, torch.Tensor]) -> torch.Tensor:
            q, zeros, s, g_idx = unpack_gptq_matrix(p, scheme)
            return record(name, q, zeros, s, g_idx, grids if scheme.bits == 4 else None)

        return _announce(_gather(weights, parts, dropped, "GPTQ", gptq), scheme, grids)
    logger.info("quantized checkpoint (%s): its matrices are dequantized as they are read",
                scheme.method)
    return dequantize_fp8(weights, scheme)


def _announce(weights: Iterator[tuple[str, torch.Tensor]], scheme: AWQScheme | GPTQScheme,
              grids: dict[str, Any] | None) -> Iterator[tuple[str, torch.Tensor]]:
    if grids is None:
        logger.info("quantized checkpoint (%s): its matrices are dequantized as they are read",
                    scheme.method)
    else:
        logger.info("quantized checkpoint (%s): its matrices are read onto int4's grid",
                    scheme.method)
    yield from weights


def _gather(weights: Iterator[tuple[str, torch.Tensor]], parts: tuple[str, ...],
            dropped: tuple[str, ...], what: str,
            build: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every matrix stored as the tensors ``X.<part>`` (any order, any shard) as one
    ``X.weight``, built by ``build("X.weight", parts)`` once all have come; tensors named
    ``X.<dropped>`` left out; the other tensors as they are."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        if kind in dropped:
            continue
        if kind not in parts:
            yield name, tensor
            continue
        have = pending.setdefault(prefix, {})
        have[kind] = tensor
        if len(have) == len(parts):
            yield prefix + ".weight", build(prefix + ".weight", pending.pop(prefix))
    if pending:
        prefix, have = next(iter(pending.items()))
        missing = [k for k in parts if k not in have]
        raise ValueError(f"{what} checkpoint: {prefix!r} has no {', '.join(missing)}")


def dequantize_fp8(weights: Iterator[tuple[str, torch.Tensor]],
                   scheme: FP8Scheme) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every float8 weight dequantized (its scale may come
    before or after it, in any shard) and the scales themselves, and the activation and KV
    scales, left out. ValueError for a float8 weight without a scale, or a scale without
    its weight."""
    suffix = "." + scheme.scale_suffix
    pending: dict[str, torch.Tensor] = {}  # weights waiting for their scale
    scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight
    dropped: set[str] = set()
    for name, tensor in weights:
        if name.endswith(suffix):
            base = name[:-len(suffix)] + ".weight"
            if base in pending:
                yield base, dequantize(pending.pop(base), tensor, scheme.block)
            else:
                scales[base] = tensor
        elif name.rsplit(".", 1)[-1] in _DROPPED:
            kind = name.rsplit(".", 1)[-1]
            if kind not in dropped:
                dropped.add(kind)
                logger.info("FP8 checkpoint: its %s tensors are not used (activations stay "
                            "in the model's dtype; the KV cache is unscaled)", kind)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if name in scales:
                yield name, dequantize(tensor, scales.pop(name), scheme.block)
            else:
                pending[name] = tensor
        else:
            yield name, tensor
    if pending or scales:
        missing = next(iter(pending), None)
        raise ValueError(
            f"FP8 checkpoint: {missing!r} has no {scheme.scale_suffix}" if missing is not None
            else f"FP8 checkpoint: a {scheme.scale_suffix} for {next(iter(scales))!r}, which "
            "is not a float8 weight of the checkpoint")
