"""The sections of :class:`~asyncengine.config.EngineConfig`, one dataclass each, and the
allowed values of its enumerated flags. Every field is one CLI flag and one YAML key; its
``metadata`` holds the flag's help text and any vLLM alias."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from asyncengine.config.multimodal import MultiModalConfig
from asyncengine.config.observability import ObservabilityConfig
from asyncengine.config.speculative import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DEVICES = ("auto", "cpu", "cuda")
# --kv-cache-dtype (vLLM's names; executor/kv/dtype.py gives them their torch dtypes)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3",
                   "fp8_e5m2")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
#: vLLM's names for the checkpoint formats asyncengine reads: accepted for a checkpoint of
#: that format (then as ``auto``), so that a ``vllm serve`` command line runs unchanged.
VLLM_QUANTIZATIONS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "fp8",
                      "compressed-tensors", "fbgemm_fp8")
POOLING_TYPES = ("last", "mean")
#: The ``--hf-overrides`` keys read (vLLM's, for a classifier made of a causal LM).
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "method",
                    "is_original_qwen3_reranker")
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
    mmproj: str | None = field(default=None, metadata={
        "help": "a GGUF model's vision projector file, as llama-server's --mmproj (llama.cpp's "
                "clip tensors: projector types mlp, idefics3, gemma3); the model then takes "
                "images, its placeholder tokens from the tokenizer"})
    mmproj_auto: bool = field(default=True, metadata={
        "help": "a hub GGUF model (-hf user/repo[:quant], user/repo:QUANT) brings its "
                "repository's mmproj*.gguf vision projector, as llama-server's -hf does; "
                "--no-mmproj-auto (llama-server's --no-mmproj): without it"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations dtype (auto: bfloat16 on CUDA and on CPUs with "
                "bf16 instructions, else float32)", "choices": DTYPES})
    quantization: str = field(default="auto", metadata={
        "help": "weight-only quantization: auto (a GGUF file on the CPU runs packed as stored: "
                "Q4_0/Q4_1 as int4, Q8_0 as int8, k-quants as gguf; anything else as none); "
                "gguf (a GGUF file's blocks kept as stored, every type); none (dequantized "
                "to --dtype); int8 (linears and the logits head, per output channel or a "
                "GGUF's Q8_0 blocks); int4 (decoder linears, blocks of 32, a GGUF's Q4_0/Q4_1 "
                "kept as stored; the logits head int8); vLLM's awq, gptq, fp8, "
                "compressed-tensors... for a checkpoint of that format (as auto)",
        "choices": QUANTIZATIONS + VLLM_QUANTIZATIONS})
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
    hf_overrides: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "a JSON object over the model's config, as vLLM takes it; the keys that make "
                "a causal LM a classifier or reranker: architectures (a "
                "*ForSequenceClassification), classifier_from_token, method, "
                "is_original_qwen3_reranker (Qwen3-Reranker: '{\"is_original_qwen3_reranker\": "
                "true}' is enough)", "aliases": ("--hf_overrides",)})
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
        "help": "KV-cache dtype: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2: "
                "one byte per value, twice the blocks in the same memory (CPU)",
        "choices": KV_CACHE_DTYPES})
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
    scheduler_config: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "options for the scheduler, a JSON object (a plugin scheduler documents its "
                "own: '{\"weights\": {\"team-a\": 3}}' for fair-share)"})

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
        "help": "structured-output backend: a registered name (xgrammar; auto: xgrammar, "
                "and llguidance for a schema xgrammar does not enforce, if installed) or "
                "pkg.module:Class", "aliases": ("--guided-decoding-backend",)})
    kv_connector: str | None = field(default=None, metadata={
        "help": "KV connector: a registered name or pkg.module:Class"})
    kv_connector_path: str | None = field(default=None, metadata={
        "help": "storage directory for the KV connector"})
    kv_transfer_config: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "the KV connector, the vLLM way (a JSON object): '{\"kv_connector\": \"redis\", "
                "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"url\": "
                "\"redis://HOST:PORT\"}}'; kv_connector_module_path imports the class "
                "kv_connector from that module"})


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (``executor/lora/``, docs/lora.md), vLLM's flags and meanings."""

    enable_lora: bool = field(default=False, metadata={
        "help": "serve PEFT LoRA adapters of the model, picked per request by their name in "
                "`model`"})
    lora_modules: list[str] | None = field(default=None, metadata={
        "help": "adapters to serve from the start: name=path, or vLLM's JSON form "
                "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'",
        "nargs": "+"})
    max_loras: int = field(default=1, metadata={
        "help": "most distinct adapters in one step (slots of the batched LoRA tables); "
                "requests for other adapters wait"})
    max_lora_rank: int = field(default=16, metadata={
        "help": "the largest adapter rank served (the slot tables' width)"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "adapters kept in CPU memory (an LRU; the others are read again from disk "
                "when used) (default: --max-loras)"})
    allow_runtime_lora_updating: bool = field(default=False, metadata={
        "help": "enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"})


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "load": LoadConfig, "device": DeviceConfig, "parallel": ParallelConfig,
            "plugins": PluginConfig, "speculative": SpeculativeConfig, "lora": LoRAConfig,
            "observability": ObservabilityConfig, "multimodal": MultiModalConfig}
#: ``serve --help`` groups the flags the way vLLM's does.
SECTION_TITLES = {"model": "ModelConfig", "cache": "CacheConfig",
                  "scheduler": "SchedulerConfig", "load": "LoadConfig",
                  "device": "DeviceConfig", "parallel": "ParallelConfig",
                  "plugins": "StructuredOutputsConfig and KVTransferConfig (plugins)",
                  "speculative": "SpeculativeConfig", "lora": "LoRAConfig",
                  "observability": "ObservabilityConfig",
                  "multimodal": "MultiModalConfig (images)"}


#: The keys of vLLM's --kv-transfer-config that asyncengine reads (others are refused, so a
#: typo is not silently ignored).
KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config",
                    "kv_connector_module_path")


def validate_kv_transfer(pc: PluginConfig) -> None:
    """Check ``--kv-transfer-config`` and make ``kv_connector`` name the connector it selects
    (a registered name, or ``module:Class`` with ``kv_connector_module_path``)."""
    flag = "--kv-transfer-config"
    cfg = pc.kv_transfer_config
    if cfg is None:
        return
    if not isinstance(cfg, dict):
        try:
            cfg = json.loads(cfg)
        except (TypeError, ValueError):
            cfg = None
        if not isinstance(cfg, dict):
            raise ValueError(f"{flag}: must be a JSON object, got {pc.kv_transfer_config!r}")
        pc.kv_transfer_config = cfg
    unknown = sorted(set(cfg) - set(KV_TRANSFER_KEYS))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {unknown} (known: {', '.join(KV_TRANSFER_KEYS)})")
    name = cfg.get("kv_connector")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{flag}: 'kv_connector' must name the connector (a registered name "
                         "such as safetensors or redis, or a class with kv_connector_module_path)")
    role = cfg.get("kv_role", "kv_both")
    if role != "kv_both":
        raise ValueError(f"{flag}: kv_role {role!r} is not supported (only 'kv_both': one "
                         "connector loads and saves)")
    extra = cfg.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError(f"{flag}: 'kv_connector_extra_config' must be a JSON object, got "
                         f"{extra!r}")
    module = cfg.get("kv_connector_module_path")
    if module is not None:
        if not isinstance(module, str) or not module.strip() or ":" in module:
            raise ValueError(f"{flag}: 'kv_connector_module_path' must be a module path "
                             f"(pkg.module), got {module!r}")
        name = f"{module.strip()}:{name.strip()}"
    name = name.strip()
    if pc.kv_connector not in (None, name):
        raise ValueError(f"--kv-connector {pc.kv_connector!r} and {flag} "
                         f"({name!r}) disagree: give one of them")
    pc.kv_connector = name


def kv_connector_extra_config(pc: PluginConfig) -> dict[str, Any]:
    """The connector's own options: ``kv_connector_extra_config`` of --kv-transfer-config."""
    cfg = pc.kv_transfer_config
    return dict(cfg.get("kv_connector_extra_config") or {}) if isinstance(cfg, dict) else {}


def validate_parallel(pc: ParallelConfig) -> None:
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


MAX_LORA_RANK = 512


def parse_lora_module(text: Any) -> tuple[str, str, str | None]:
    """One ``--lora-modules`` entry -> (name, path, base model name or None): ``name=path``
    or vLLM's JSON object ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    import json

    if isinstance(text, dict):
        obj: Any = text
    elif isinstance(text, str) and text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON: {e}") from None
    elif isinstance(text, str) and "=" in text:
        name, _, path = text.partition("=")
        obj = {"name": name.strip(), "path": path.strip()}
    else:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise ValueError(f"--lora-modules: {text!r} needs a non-empty name and path")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules: base_model_name must be a string in {text!r}")
    return name, path, base


def validate_lora(lc: LoRAConfig, tensor_parallel_size: int, compile_: bool) -> None:
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(lc, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ValueError(f"--{name.replace('_', '-')}: must be a positive integer, "
                             f"got {value!r}")
    if lc.max_lora_rank > MAX_LORA_RANK:
        raise ValueError(f"--max-lora-rank: at most {MAX_LORA_RANK}, got {lc.max_lora_rank}")
    if lc.max_cpu_loras is not None and lc.max_cpu_loras < lc.max_loras:
        raise ValueError(f"--max-cpu-loras ({lc.max_cpu_loras}) must be at least --max-loras "
                         f"({lc.max_loras})")
    if isinstance(lc.lora_modules, str):
        lc.lora_modules = [lc.lora_modules]
    names = [parse_lora_module(m)[0] for m in lc.lora_modules or ()]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: an adapter name is given twice ({', '.join(names)})")
    if lc.lora_modules and not lc.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if lc.enable_lora and tensor_parallel_size > 1:
        raise ValueError("--enable-lora: not supported with --tensor-parallel-size > 1")
    if lc.enable_lora and compile_:
        raise ValueError("--enable-lora: not supported with --compile (the adapters' batched "
                         "op is not traced); drop one of them")
