"""EngineConfig: the configuration tree, built from CLI flags and/or a YAML file.

Every leaf field is one CLI flag (``--max-num-seqs`` ↔ ``scheduler.max_num_seqs``) and one
YAML key; the YAML may be flat (``max-num-seqs: 64``) or nested by section
(``scheduler: {max_num_seqs: 64}``). Flags given on the command line win over the YAML.
Validation errors are ``ValueError`` messages that name the flag and the allowed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
POOLING_TYPES = ("last", "mean")
GENERATION_CONFIG_HELP = (
    "server-side sampling defaults: auto (the model's generation_config.json: temperature, "
    "top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (none: OpenAI's "
    "defaults), or a directory holding a generation_config.json")


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
    quantization: str = field(default="auto", metadata={
        "help": "weight-only quantization: auto (a GGUF file on the CPU runs packed as stored: "
                "Q4_0/Q4_1 as int4, Q8_0 as int8; anything else as none); none (dequantized "
                "to --dtype); int8 (linears and the logits head, per output channel or a "
                "GGUF's Q8_0 blocks); int4 (decoder linears, blocks of 32, a GGUF's Q4_0/Q4_1 "
                "kept as stored; the logits head int8)", "choices": QUANTIZATIONS})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length (default: the model's, capped at 8192)"})
    served_model_name: list[str] | None = field(default=None, metadata={
        "help": "the model names clients may use; the first is the one responses and "
                "metrics carry (default: the model argument)", "nargs": "+"})
    seed: int = field(default=0, metadata={"help": "seed for dummy weights and unseeded "
                                           "sampling"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template, or a file holding one"})
    generation_config: str = field(default="auto", metadata={"help": GENERATION_CONFIG_HELP})
    override_generation_config: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "JSON object of sampling defaults over the generation config's, e.g. "
                "'{\"temperature\": 0.5}'"})
    max_logprobs: int = field(default=20, metadata={
        "help": "most logprobs a request may ask for per token"})
    pooling_type: str = field(default="last", metadata={
        "help": "how /v1/embeddings pools the final hidden states: last (token) or mean",
        "choices": POOLING_TYPES})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "accepted for vLLM compatibility; the model code here is our own, so no code "
                "from the model repository ever runs"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run decode steps eagerly instead of replaying CUDA graphs captured per "
                "batch-size bucket (no effect on the CPU)"})


@dataclass
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: str = field(default="auto", metadata={
        "help": "KV-cache size, e.g. 2GiB or 512MiB (auto: 1 GiB on the CPU; on CUDA what "
                "--gpu-memory-utilization leaves after a profiling run)",
        "aliases": ("--kv-cache-memory-bytes",)})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of the GPU's total memory this engine may use in all (weights, "
                "activations, KV cache), as in vLLM: the KV cache gets what a profiling run "
                "leaves of it (CUDA only)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV-cache dtype: auto (the model's dtype; the only one supported)"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "use exactly this many KV-cache blocks (testing)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse KV blocks of identical prompt prefixes"})


@dataclass
class SchedulerConfig:
    scheduler: str = field(default="fcfs", metadata={
        "help": "scheduler: a registered name (fcfs, priority) or pkg.module:Class",
        "aliases": ("--scheduling-policy",)})
    max_num_seqs: int = field(default=64, metadata={"help": "most requests in one step"})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "most tokens computed in one step"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prefills across steps"})
    max_queued_requests: int | None = field(default=None, metadata={
        "help": "most requests waiting to be scheduled; past it new requests are refused "
                "(HTTP 503 with Retry-After) (default: max(256, 4 x --max-num-seqs))"})
    max_n: int = field(default=128, metadata={
        "help": "most samples one request may ask for (n)"})

    @property
    def queued_request_limit(self) -> int:
        """``max_queued_requests``, or its default: enough for four full batches (the newest
        waiting request starts within about four request lifetimes), at least 256 so that a
        small ``--max-num-seqs`` does not refuse ordinary bursts."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return max(256, 4 * self.max_num_seqs)


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
    compile: bool = field(default=False, metadata={
        "help": "CPU: run the decoder forward through torch.compile (inductor), one graph per "
                "token bucket, compiled at start-up and cached under "
                "~/.cache/asyncengine/inductor (see docs/serving.md, CPU speed)"})
    compile_max_tokens: int = field(default=32, metadata={
        "help": "with --compile: the largest step (in tokens) that runs compiled; buckets are "
                "the powers of two up to it, larger steps run eagerly"})
    attention_backend: str = field(default="auto", metadata={
        "help": "attention kernels (auto: flashinfer on CUDA when installed and the dtype is "
                "bfloat16/float16, else torch_paged)",
        "choices": ("auto", "torch_paged", "flashinfer")})


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes (devices) the model is sharded over, Megatron-style: rank 0 serves, "
                "ranks 1..N-1 are worker processes (gloo on the CPU, NCCL on CUDA)",
        "aliases": ("-tp",)})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "pipeline stages (only 1)", "aliases": ("-pp",)})
    distributed_init_method: str | None = field(default=None, metadata={
        "help": "torch.distributed rendezvous of the tensor-parallel ranks, tcp://HOST:PORT "
                "(default: a free port on 127.0.0.1; required with --nnodes > 1)"})
    nnodes: int = field(default=1, metadata={
        "help": "nodes the tensor-parallel ranks span (each runs "
                "--tensor-parallel-size / --nnodes of them)"})
    node_rank: int = field(default=0, metadata={
        "help": "this node's index: 0 serves (ranks 0..), others only run worker ranks"})


@dataclass
class PluginConfig:
    structured_output_backend: str = field(default="xgrammar", metadata={
        "help": "structured-output backend: a registered name or pkg.module:Class (auto: "
                "xgrammar)", "aliases": ("--guided-decoding-backend",)})
    kv_connector: str | None = field(default=None, metadata={
        "help": "KV connector: a registered name or pkg.module:Class"})
    kv_connector_path: str | None = field(default=None, metadata={
        "help": "storage directory for the KV connector"})


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "load": LoadConfig, "device": DeviceConfig, "parallel": ParallelConfig,
            "plugins": PluginConfig}
#: ``serve --help`` groups the flags the way vLLM's does.
SECTION_TITLES = {"model": "ModelConfig", "cache": "CacheConfig",
                  "scheduler": "SchedulerConfig", "load": "LoadConfig",
                  "device": "DeviceConfig", "parallel": "ParallelConfig",
                  "plugins": "StructuredOutputsConfig and KVTransferConfig (plugins)"}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)

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
            for k, v in _flatten(cls.from_yaml(args.config)).items():
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
                raise ValueError(f"{_flag(name)}: invalid value {value!r} (allowed: "
                                 f"{', '.join(choices)})")

        def check_positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{_flag(name)}: must be a positive integer, got {value!r}")

        mc, cc = self.model, self.cache
        check_choice("dtype", mc.dtype, DTYPES)
        check_choice("quantization", mc.quantization, QUANTIZATIONS)
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
        if cc.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {cc.kv_cache_dtype}: not supported; the KV cache "
                             "is kept in the model's dtype (only 'auto')")
        _validate_parallel(self.parallel)
        if self.device.compile and self.parallel.tensor_parallel_size > 1:
            raise ValueError("--compile: not supported with --tensor-parallel-size > 1 (the "
                             "collectives are not traced); drop one of them")
        if isinstance(mc.served_model_name, str):
            mc.served_model_name = [mc.served_model_name]
        if mc.served_model_name is not None and not (
                mc.served_model_name and all(isinstance(n, str) and n
                                             for n in mc.served_model_name)):
            raise ValueError("--served-model-name: give one or more non-empty names")
        mc.override_generation_config = _json_object(mc.override_generation_config,
                                                     "override_generation_config")
        gen = mc.generation_config
        if gen not in ("auto", "vllm") and not Path(gen, "generation_config.json").is_file():
            raise ValueError(f"--generation-config: no generation_config.json in {gen!r} (give "
                             "auto, vllm, or a directory holding one)")
        if self.plugins.structured_output_backend == "auto":  # vLLM's default value
            self.plugins.structured_output_backend = "xgrammar"

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


def _validate_parallel(pc: ParallelConfig) -> None:
    if pc.pipeline_parallel_size > 1:
        raise ValueError(f"--pipeline-parallel-size {pc.pipeline_parallel_size}: not supported "
                         "(one pipeline stage); use --tensor-parallel-size to shard a model")
    tp, nnodes = pc.tensor_parallel_size, pc.nnodes
    if not isinstance(pc.node_rank, int) or not 0 <= pc.node_rank < nnodes:
        raise ValueError(f"--node-rank {pc.node_rank!r}: must be in [0, --nnodes {nnodes})")
    if tp % nnodes:
        raise ValueError(f"--tensor-parallel-size {tp} must be a multiple of --nnodes {nnodes} "
                         "(every node runs the same number of ranks)")
    method = pc.distributed_init_method
    if method is not None and not re.match(r"^tcp://[^:/]+:\d+$", method):
        raise ValueError(f"--distributed-init-method {method!r}: expected tcp://HOST:PORT")
    if nnodes > 1 and method is None:
        raise ValueError("--nnodes > 1 needs --distributed-init-method tcp://HOST:PORT (the "
                         "address of node 0, reachable from every node)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_object(value: Any, name: str) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{_flag(name)}: must be a JSON object, got {value!r}")
    return parsed


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
