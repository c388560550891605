"""EngineConfig: the configuration tree, built from CLI flags and/or a YAML file.

Every leaf field is one CLI flag (``--max-num-seqs`` ↔ ``scheduler.max_num_seqs``) and one
YAML key; the YAML may be flat (``max-num-seqs: 64``) or nested by section
(``scheduler: {max_num_seqs: 64}``). Flags given on the command line win over the YAML.
Validation errors are ``ValueError`` messages that name the flag and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("none", "int8")


@dataclass
class ModelConfig:
    model: str | None = field(
        default=None, metadata={"help": "HF directory, hub id or .gguf file (default: the "
                                "embedded SmolLM2-135M-Instruct)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer path or id "
                                                          "(default: the model's)"})
    revision: str | None = field(default=None, metadata={"help": "hub revision"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations dtype (auto: bfloat16 on CUDA and on CPUs with "
                "bf16 instructions, else float32)", "choices": DTYPES})
    quantization: str = field(default="none", metadata={
        "help": "weight quantization of the linear layers and the logits head: none, or int8 "
                "(per-output-channel weight-only; faster decoding of small batches on CPUs "
                "with bfloat16, at a small accuracy cost)", "choices": QUANTIZATIONS})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length (default: the model's, capped at 8192)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model name clients use (default: the model argument)"})
    seed: int = field(default=0, metadata={"help": "seed for dummy weights and unseeded "
                                           "sampling"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template, or a file holding one"})


@dataclass
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: str = field(default="auto", metadata={
        "help": "KV-cache size, e.g. 2GiB or 512MiB (auto: 1 GiB on the CPU, 90%% of free "
                "memory on CUDA)"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "use exactly this many KV-cache blocks (testing)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse KV blocks of identical prompt prefixes"})


@dataclass
class SchedulerConfig:
    scheduler: str = field(default="fcfs", metadata={
        "help": "scheduler: a registered name (fcfs, priority) or pkg.module:Class"})
    max_num_seqs: int = field(default=64, metadata={"help": "most requests in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "most tokens computed in one step"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prefills across steps"})


@dataclass
class LoadConfig:
    load_format: str = field(default="auto", metadata={"help": "how to read weights",
                                                       "choices": LOAD_FORMATS})
    download_dir: str | None = field(default=None, metadata={"help": "hub cache directory"})


@dataclass
class DeviceConfig:
    device: str = field(default="auto", metadata={"help": "where to run", "choices": DEVICES})
    num_threads: int | None = field(default=None, metadata={
        "help": "CPU threads for the forward pass (default: all cores)"})
    attention_backend: str = field(default="auto", metadata={
        "help": "attention kernels", "choices": ("auto", "torch_paged")})


@dataclass
class PluginConfig:
    structured_output_backend: str = field(default="xgrammar", metadata={
        "help": "structured-output backend: a registered name or pkg.module:Class"})
    kv_connector: str | None = field(default=None, metadata={
        "help": "KV connector: a registered name or pkg.module:Class"})
    kv_connector_path: str | None = field(default=None, metadata={
        "help": "storage directory for the KV connector"})


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "load": LoadConfig, "device": DeviceConfig, "plugins": PluginConfig}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)

    def __post_init__(self) -> None:
        self.validate()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """From a flat ({'max_num_seqs': 8}) or nested ({'scheduler': {...}}) mapping."""
        flat: dict[str, Any] = {}
        for key, value in values.items():
            key = key.replace("-", "_")
            if key in SECTIONS and isinstance(value, dict):
                for k, v in value.items():
                    k = k.replace("-", "_")
                    if k not in _SECTION_OF or _SECTION_OF[k] != key:
                        raise ValueError(f"unknown config key {key}.{k}")
                    flat[k] = v
            elif key in _SECTION_OF:
                flat[key] = value
            else:
                raise ValueError(f"unknown config key {key!r} (see `asyncengine serve --help`)")
        parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for k, v in flat.items():
            parts[_SECTION_OF[k]][k] = v
        return cls(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> dict[str, Any]:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ValueError(f"--config: file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"--config: {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config: {path} must hold a mapping of option names to values")
        return data

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        """Defaults < YAML file (``--config``) < flags given on the command line."""
        values: dict[str, Any] = {}
        if getattr(args, "config", None):
            values.update(_flatten(cls.from_yaml(args.config)))
        for name in _SECTION_OF:
            v = getattr(args, name, None)
            if v is not None:
                values[name] = v
        return cls.from_dict(values)

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
            if value not in choices:
                raise ValueError(f"{_flag(name)}: invalid value {value!r} (allowed: "
                                 f"{', '.join(choices)})")

        def check_positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{_flag(name)}: must be a positive integer, got {value!r}")

        check_choice("dtype", self.model.dtype, DTYPES)
        check_choice("quantization", self.model.quantization, QUANTIZATIONS)
        check_choice("load_format", self.load.load_format, LOAD_FORMATS)
        check_choice("device", self.device.device, DEVICES)
        for name, value in (("block_size", self.cache.block_size),
                            ("max_num_seqs", self.scheduler.max_num_seqs),
                            ("max_num_batched_tokens", self.scheduler.max_num_batched_tokens),
                            ("max_model_len", self.model.max_model_len),
                            ("num_threads", self.device.num_threads),
                            ("num_gpu_blocks_override", self.cache.num_gpu_blocks_override)):
            check_positive(name, value)
        if self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError(f"--block-size: must be a power of two, got {self.cache.block_size}")
        if self.cache.kv_cache_memory != "auto":
            parse_size(self.cache.kv_cache_memory, "kv_cache_memory")
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs:
            raise ValueError("--max-num-batched-tokens must be at least --max-num-seqs")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some leaf fields changed, by flat name."""
        parts = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        for k, v in changes.items():
            if k not in _SECTION_OF:
                raise ValueError(f"unknown config key {k!r}")
            parts[_SECTION_OF[k]][k] = v
        return EngineConfig(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})


_SECTION_OF: dict[str, str] = {f.name: s for s, c in SECTIONS.items() for f in fields(c)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        k = k.replace("-", "_")
        if k in SECTIONS and isinstance(v, dict):
            for kk, vv in v.items():
                out[kk.replace("-", "_")] = vv
        else:
            out[k] = v
    return out


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}


def parse_size(text: str | int, name: str = "size") -> int:
    """'2GiB' -> 2147483648. Bare numbers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"{_flag(name)}: cannot read {text!r} as a size (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per config leaf. Defaults are None so YAML values are not overridden."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in fields(cls):
            if f.name == "model":
                continue  # positional in the CLI
            flag = _flag(f.name)
            help_ = f.metadata.get("help", "")
            default = f.default if f.default is not dataclasses.MISSING else None
            if "default:" not in help_ and "auto:" not in help_:
                help_ = f"{help_} (default: {default})"

            if f.type in ("bool", bool):
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=None, help=help_)
                continue
            kind = int if "int" in str(f.type) else str
            kw: dict[str, Any] = {"dest": f.name, "type": kind, "default": None}
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(flag, help=help_, **kw)
    return parser
