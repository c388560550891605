"""Loading one rank's shard of the weights.

safetensors: every tensor is read through ``safe_open(...).get_slice(name)``, so a rank reads
only its rows (or columns) of each split weight from the file. GGUF: the file's tensors are
dequantized whole, then sliced (a GGUF is one file of quantized blocks; reading a slice of
rows of a quantized tensor would need its block layout: not done). dummy: random weights,
seeded per rank (the same seed on every rank gives each shard the same values as the same
shard of another run, not the values of a TP=1 model: fine for benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from asyncengine.executor.models.family import describe
from asyncengine.executor.models.llama import LlamaForCausalLM
from asyncengine.executor.parallel.model import TPLlamaForCausalLM
from asyncengine.executor.parallel.sharding import (
    FLAG,
    Getter,
    ShardPlan,
    make_plan,
    shard_tensor,
    slice_getter,
    tensor_getter,
    unfused,
)
from asyncengine.executor.parallel.state import TPState
from asyncengine.executor.weights import loader as base


def load_tp_model(source: base.ModelSource, load_format: str, dtype: torch.dtype,
                  device: torch.device | str, tp: TPState, *, seed: int = 0,
                  model_cls: type | None = None, quantization: str = "none") -> nn.Module:
    """This rank's :class:`TPLlamaForCausalLM`, with its shard of the weights."""
    if model_cls is not None and not issubclass(model_cls, LlamaForCausalLM):
        raise ValueError(f"{FLAG} {tp.world_size}: only the built-in decoder (every built-in "
                         f"family) can be sharded, not {model_cls.__name__}")
    from asyncengine.executor.weights.checkpoint_quant import checkpoint_quantization
    from asyncengine.executor.weights.quantization import from_vllm_method

    if base._load_format(source, load_format) == "safetensors":  # vLLM's names: auto
        quantization = from_vllm_method(quantization,
                                        checkpoint_quantization(source.hf_config, source.name))
    if quantization not in ("none", "auto"):  # auto: the shards are dequantized
        raise ValueError(f"--quantization {quantization} cannot be combined with {FLAG} > 1 "
                         "(yet)")
    config = source.hf_config
    plan = make_plan(config, tp.rank, tp.world_size)
    fmt = base._load_format(source, load_format)
    if fmt == "gguf" and describe(config).moe is not None:
        raise ValueError(f"{FLAG} {tp.world_size}: a GGUF mixture of experts is not sharded "
                         "(its experts are stacked; use the safetensors checkpoint)")
    device = torch.device(device)
    with base._default_dtype(dtype), device:
        model = TPLlamaForCausalLM(config, plan, tp)
    if fmt == "dummy":
        base._fill_dummy(model, seed, getattr(config, "initializer_range", 0.02))
    elif fmt == "gguf":
        from asyncengine.executor.weights.gguf import iter_gguf_tensors

        model.load_weights(_shards(((name, tensor_getter(t)) for name, t
                                    in iter_gguf_tensors(source.gguf_path, config, None)), plan))
    else:
        from asyncengine.executor.weights.checkpoint_quant import (
            checkpoint_quantization,
            dequantize_checkpoint,
        )

        files = base.safetensors_files(source.path)
        quantized = checkpoint_quantization(config, source.name)
        if quantized is None:
            model.load_weights(_iter_sharded_safetensors(files, plan))
        else:  # whole quantized matrices dequantized, then sharded
            model.load_weights(_shards(
                ((name, tensor_getter(t)) for name, t
                 in dequantize_checkpoint(base._iter_safetensors(files), quantized)), plan))
    return model.eval()


def _shards(tensors: Iterator[tuple[str, Getter]],
            plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of each ``(name, getter)``, fused projections read as their parts."""
    for name, get in tensors:
        for part, part_get in unfused(name, get, plan):
            yield part, shard_tensor(part, part_get, plan)


def _iter_sharded_safetensors(files: list[str],
                              plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            yield from _shards(((key, slice_getter(f.get_slice(key)))
                                for key in f.keys()), plan)  # noqa: SIM118 (not a mapping)

