"""EngineConfig: the configuration tree, built from CLI flags and/or a YAML file.

Every leaf field is one CLI flag (``--max-num-seqs`` ↔ ``scheduler.max_num_seqs``) and one
YAML key; the YAML may be flat (``max-num-seqs: 64``) or nested by section
(``scheduler: {max_num_seqs: 64}``). Flags given on the command line win over the YAML.
Validation errors are ``ValueError`` messages that name the flag and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from asyncengine.config.multimodal import MultiModalConfig, validate_multimodal
from asyncengine.config.observability import ObservabilityConfig, validate_observability
from asyncengine.config.sections import (
    DEVICES,
    DTYPES,
    GENERATION_CONFIG_HELP,
    HF_OVERRIDE_KEYS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POOLING_TYPES,
    QUANTIZATIONS,
    SECTION_TITLES,
    SECTIONS,
    VLLM_QUANTIZATIONS,
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PluginConfig,
    SchedulerConfig,
    kv_connector_extra_config,
    validate_kv_transfer,
    validate_lora,
    validate_parallel,
)
from asyncengine.config.speculative import (
    SpeculativeConfig,
    SpeculativeSettings,
    parse_speculative,
)
from asyncengine.config.values import flag, flatten, json_object, parse_size

__all__ = [
    "ALIASES", "DEVICES", "DTYPES", "GENERATION_CONFIG_HELP", "LOAD_FORMATS", "POOLING_TYPES",
    "QUANTIZATIONS", "SECTIONS", "SECTION_TITLES", "CacheConfig", "DeviceConfig", "EngineConfig",
    "VLLM_QUANTIZATIONS", "LoRAConfig", "LoadConfig", "ModelConfig", "MultiModalConfig",
    "ObservabilityConfig", "ParallelConfig", "PluginConfig", "SchedulerConfig",
    "SpeculativeConfig", "SpeculativeSettings",
    "kv_connector_extra_config", "parse_size",
]


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)

    def __post_init__(self) -> None:
        self.validate()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """From a flat ({'max_num_seqs': 8}) or nested ({'scheduler': {...}}) mapping; vLLM's
        names are accepted for the leaves where ours differ (``scheduling_policy``...)."""
        flat: dict[str, Any] = {}
        for key, value in values.items():
            key = key.replace("-", "_")
            if key in SECTIONS and isinstance(value, dict):
                for k, v in value.items():
                    k = ALIASES.get(k.replace("-", "_"), k.replace("-", "_"))
                    if k not in _SECTION_OF or _SECTION_OF[k] != key:
                        raise ValueError(f"unknown config key {key}.{k}")
                    flat[k] = v
            elif ALIASES.get(key, key) in _SECTION_OF:
                flat[ALIASES.get(key, key)] = value
            else:
                raise ValueError(f"unknown config key {key!r} (see `asyncengine serve --help`)")
        parts: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        for k, v in flat.items():
            parts[_SECTION_OF[k]][k] = v
        return cls(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> dict[str, Any]:
        """The YAML file's options, flat (sections merged), keys with underscores."""
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
        """Defaults < YAML file (``--config``) < flags given on the command line. YAML keys
        that are other flags of the command (``port``, ``host``...) are left to it."""
        values: dict[str, Any] = {}
        if getattr(args, "config", None):
            for k, v in flatten(cls.from_yaml(args.config)).items():
                if ALIASES.get(k, k) in _SECTION_OF or not hasattr(args, k):
                    values[k] = v
        for name in _SECTION_OF:
            v = getattr(args, name, None)
            if v is not None:
                values[name] = v
        return cls.from_dict(values)

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
            if value not in choices:
                raise ValueError(f"{flag(name)}: invalid value {value!r} (allowed: "
                                 f"{', '.join(choices)})")

        def check_positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag(name)}: must be a positive integer, got {value!r}")

        mc, cc = self.model, self.cache
        check_choice("dtype", mc.dtype, DTYPES)
        check_choice("quantization", mc.quantization, QUANTIZATIONS + VLLM_QUANTIZATIONS)
        check_choice("pooling_type", mc.pooling_type, POOLING_TYPES)
        check_choice("load_format", self.load.load_format, LOAD_FORMATS)
        check_choice("device", self.device.device, DEVICES)
        for name, value in (("block_size", cc.block_size),
                            ("max_num_seqs", self.scheduler.max_num_seqs),
                            ("max_num_batched_tokens", self.scheduler.max_num_batched_tokens),
                            ("max_model_len", mc.max_model_len),
                            ("max_logprobs", mc.max_logprobs),
                            ("num_threads", self.device.num_threads),
                            ("compile_max_tokens", self.device.compile_max_tokens),
                            ("num_gpu_blocks_override", cc.num_gpu_blocks_override),
                            ("tensor_parallel_size", self.parallel.tensor_parallel_size),
                            ("pipeline_parallel_size", self.parallel.pipeline_parallel_size),
                            ("nnodes", self.parallel.nnodes),
                            ("max_queued_requests", self.scheduler.max_queued_requests),
                            ("max_n", self.scheduler.max_n)):
            check_positive(name, value)
        if cc.block_size & (cc.block_size - 1):
            raise ValueError(f"--block-size: must be a power of two, got {cc.block_size}")
        if cc.kv_cache_memory != "auto":
            parse_size(cc.kv_cache_memory, "kv_cache_memory")
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs:
            raise ValueError("--max-num-batched-tokens must be at least --max-num-seqs")
        if not 0 < cc.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization: must be in (0, 1], got "
                             f"{cc.gpu_memory_utilization}")
        check_choice("kv_cache_dtype", cc.kv_cache_dtype, KV_CACHE_DTYPES)
        if cc.kv_cache_dtype.startswith("fp8") and self.device.device == "cuda":
            raise ValueError(f"--kv-cache-dtype {cc.kv_cache_dtype}: on the CPU only; the "
                             "float8 cache's CUDA path has not run on a GPU (use auto there)")
        validate_parallel(self.parallel)
        validate_lora(self.lora, self.parallel.tensor_parallel_size, self.device.compile)
        if self.device.compile and self.parallel.tensor_parallel_size > 1:
            raise ValueError("--compile: not supported with --tensor-parallel-size > 1 (the "
                             "collectives are not traced); drop one of them")
        if isinstance(mc.served_model_name, str):
            mc.served_model_name = [mc.served_model_name]
        if mc.served_model_name is not None and not (
                mc.served_model_name and all(isinstance(n, str) and n
                                             for n in mc.served_model_name)):
            raise ValueError("--served-model-name: give one or more non-empty names")
        mc.override_generation_config = json_object(mc.override_generation_config,
                                                     "override_generation_config")
        self.scheduler.scheduler_config = json_object(self.scheduler.scheduler_config,
                                                      "scheduler_config")
        mc.hf_overrides = json_object(mc.hf_overrides, "hf_overrides")
        unknown = sorted(set(mc.hf_overrides or ()) - set(HF_OVERRIDE_KEYS))
        if unknown:
            raise ValueError(f"--hf-overrides: overriding {', '.join(unknown)} is not supported "
                             f"(asyncengine reads {', '.join(HF_OVERRIDE_KEYS)}: a classifier "
                             "made of a causal LM)")
        gen = mc.generation_config
        if gen not in ("auto", "vllm") and not Path(gen, "generation_config.json").is_file():
            raise ValueError(f"--generation-config: no generation_config.json in {gen!r} (give "
                             "auto, vllm, or a directory holding one)")
        self.speculative_settings: SpeculativeSettings | None = parse_speculative(
            self.speculative.speculative_config)
        validate_kv_transfer(self.plugins)
        validate_observability(self.observability)
        validate_multimodal(self.multimodal)
        if parse_size(self.multimodal.max_media_bytes, "max_media_bytes") < 1:
            raise ValueError("--max-media-bytes: must be positive, got "
                             f"{self.multimodal.max_media_bytes!r}")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some leaf fields changed, by flat name."""
        parts = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        for k, v in changes.items():
            if k not in _SECTION_OF:
                raise ValueError(f"unknown config key {k!r}")
            parts[_SECTION_OF[k]][k] = v
        return EngineConfig(**{s: SECTIONS[s](**kw) for s, kw in parts.items()})


_SECTION_OF: dict[str, str] = {f.name: s for s, c in SECTIONS.items() for f in fields(c)}
#: vLLM's names for our leaves (YAML keys and flags), e.g. scheduling_policy -> scheduler.
ALIASES: dict[str, str] = {
    a.lstrip("-").replace("-", "_"): f.name
    for c in SECTIONS.values() for f in fields(c) for a in f.metadata.get("aliases", ())
    if a.startswith("--")}
