"""A GGUF file's Q4_0 / Q4_1 / Q8_0 matrices straight into int4 / int8 layers
(``--quantization auto`` on such a file, the embedded SmolLM2's among them), one layer at a
time as the file is read, never through the model's float linears; the token embedding stays
the file's blocks, and a tied vocabulary is held once."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncengine.executor.weights.int4 import Int4Linear
from asyncengine.executor.weights.int8 import Int8Embedding, Int8Linear, quantize_int8
from asyncengine.executor.weights.quantization import checkpoint_shards, q8_grid


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
                          for p in checkpoint_shards(child_name)]
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
            layer: nn.Module = Int8Linear(w, bias, q8_grid(grids, grid_names),
                                          float32_out=True)
        elif method == "int4":
            grid = None
            if all(n in grids and grids[n].kind == "q4" for n in grid_names):
                grid = tuple(torch.cat([torch.from_numpy(getattr(grids[n], f))
                                        for n in grid_names]) for f in ("scale", "other"))
            layer = Int4Linear(w, bias, grid)
        else:
            layer = Int8Linear(w, bias, q8_grid(grids, grid_names))
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
