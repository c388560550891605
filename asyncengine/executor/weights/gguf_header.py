"""A GGUF file's header, read fast, and the transformers config it describes.

The header is parsed here rather than with ``gguf.GGUFReader``, which turns every vocabulary
entry into numpy objects (seconds for a 49k vocabulary); string arrays are skipped (their
count is kept). ``gguf.py`` maps the tensors it lists to the model's names.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncengine.executor.weights import gguf_arch

# GGUF architectures whose config is built here (others go through transformers).
CONFIG_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF metadata value types: id -> struct format (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}


@dataclass
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (a row's length)
    ggml_type: int
    offset: int  # from the start of the file


@dataclass
class StringArray:
    """A skipped array of strings (the vocabulary, merges): only its length is kept."""

    count: int


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    path: str = ""


def read_header(path: str) -> GGUFHeader:
    """Parse the metadata and tensor table of a GGUF (v2/v3) file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse_header(path, buf)
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({e})") from None


def _parse_header(path: str, buf: mmap.mmap) -> GGUFHeader:
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return buf[pos - n:pos].decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == 8:
            return string()
        if kind != 9:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")
        elem, count = take("I"), take("Q")
        if elem == 8:
            for _ in range(count):
                n = take("Q")  # (not `pos += take(...)`: take moves pos first)
                pos += n
            return StringArray(count)
        if elem in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[elem])
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
            pos += dtype.itemsize * count
            return arr
        return [value(elem) for _ in range(count)]

    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
    metadata = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("Q") for _ in range(take("I")))
        infos.append((name, dims, take("I"), take("Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = (pos + align - 1) // align * align
    tensors = [TensorInfo(n, d, t, data_start + o) for n, d, t, o in infos]
    return GGUFHeader(metadata, tensors, path)


def config_from_header(header: GGUFHeader) -> Any | None:
    """A transformers config for a GGUF file; ValueError naming the supported architectures
    for any other."""
    from transformers import AutoConfig

    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in CONFIG_ARCHS and arch not in gguf_arch.LAYER_NAMES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(gguf_arch.SUPPORTED)})")

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    tokens = md.get("tokenizer.ggml.tokens")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    kw: dict[str, Any] = dict(
        vocab_size=get("vocab_size") or (tokens.count if isinstance(tokens, StringArray) else 0),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        head_dim=get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        tie_word_embeddings=all(t.name != "output.weight" for t in header.tensors),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )
    special = gguf_arch.config(arch, md, kw, lambda name: _small_tensor(header, name))
    if special is not None:  # Gemma, Phi, the MoE ones: their own config classes
        return special
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(get("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    kw["rope_parameters"] = rope
    if arch == "mistral" and get("attention.sliding_window"):
        kw["sliding_window"] = get("attention.sliding_window")
    return AutoConfig.for_model(CONFIG_ARCHS[arch], **kw)


def _small_tensor(header: GGUFHeader, name: str) -> np.ndarray | None:
    """An F32 tensor of the file (a few values: RoPE factors), None if absent."""
    for t in header.tensors:
        if t.name == name:
            if t.ggml_type != 0:
                raise ValueError(f"{header.path}: GGUF tensor {name} is not F32")
            count = int(np.prod(t.dims, dtype=np.int64))
            return np.fromfile(header.path, dtype="<f4", count=count, offset=t.offset)
    return None
