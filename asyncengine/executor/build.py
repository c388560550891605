"""Start-up: build what the engine runs on, once.

:func:`build` resolves the components named in the configuration (scheduler,
structured-output backend, KV connector, model architecture) through the plugin registry,
loads the weights and the tokenizer, sizes and allocates the KV cache, and makes the device and
the model runner. The engine receives the result, :class:`EngineParts`, and owns it from then
on; nothing here runs per step.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.sched import BUILTIN_SCHEDULERS
from asyncengine.core.sched.interface import Scheduler
from asyncengine.executor.attention import AttentionShape, get_attention_backend
from asyncengine.executor.kv.dtype import kv_cache_dtype
from asyncengine.executor.kv.sizing import (
    max_model_len_of,
    num_kv_blocks,
)
from asyncengine.executor.models.classifier import apply_hf_overrides
from asyncengine.executor.models.registry import architecture_of
from asyncengine.executor.models.vision.setup import attach_mmproj, setup_vision
from asyncengine.executor.models.vision.spec import describe_vision
from asyncengine.executor.paths.base import PathContext
from asyncengine.executor.paths.choose import choose
from asyncengine.executor.runner import ModelRunner
from asyncengine.executor.runtime.device import Device
from asyncengine.executor.runtime.devices import make_device
from asyncengine.executor.weights import kquants
from asyncengine.executor.weights.loader import load_model, pick_dtype, resolve_model
from asyncengine.ext import registry
from asyncengine.ext.contracts.kv_connector import KVCacheLayout, KVConnector, model_identity
from asyncengine.text.generation_config import load_generation_defaults
from asyncengine.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("asyncengine")



@dataclass
class EngineParts:
    """What :func:`build` makes: the model behind its runner and device, the tokenizer, the
    sizes, and the component classes chosen by name."""

    config: EngineConfig
    model_name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    num_blocks: int
    dtype: torch.dtype
    device: Device
    runner: ModelRunner
    scheduler_cls: type
    structured_output_backend_cls: type
    kv_connector: KVConnector | None
    # Sampling defaults from generation_config.json (--generation-config): SamplingParams names.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # --tensor-parallel-size > 1: rank 0's group and its node's workers (parallel/launch.py).
    parallel: Any = None
    # Every layer's attention window (None: some layer sees the whole context): the KV cache
    # manager releases blocks wholly before the window (core/kv/manager.py).
    sliding_window: int | None = None

    def make_scheduler(self) -> Scheduler:
        config = self.config.replace(max_model_len=self.max_model_len)
        scheduler = self.scheduler_cls(config, self.num_blocks)
        kv = getattr(scheduler, "kv_cache_manager", None)
        if self.sliding_window and self.kv_connector is None and kv is not None:
            kv.sliding_window = self.sliding_window  # (a connector saves whole tables)
        if self.kv_connector is not None:
            scheduler.set_kv_connector(self.kv_connector)
        return scheduler


def build(config: EngineConfig, plugin_manager: Any = None) -> EngineParts:
    """Everything the engine needs, from its configuration (slow: loads the weights)."""
    started: list[Any] = []  # the tensor-parallel group, once its workers run
    try:
        return _build(config, plugin_manager, started)
    except BaseException:
        for parallel in started:
            parallel.abort()
        raise


def _build(config: EngineConfig, plugin_manager: Any, started: list[Any]) -> EngineParts:
    # Components named in the config are resolved (and contract-checked) before the slow
    # part, so a typo in --scheduler fails at once.
    scheduler_cls = registry.resolve_scheduler(config.scheduler.scheduler, plugin_manager)
    if config.scheduler.scheduler_config and scheduler_cls in BUILTIN_SCHEDULERS.values():
        raise ValueError(f"--scheduler-config: the built-in scheduler "
                         f"{config.scheduler.scheduler!r} takes no options (got "
                         f"{sorted(config.scheduler.scheduler_config)})")
    so_backend_cls = registry.resolve_structured_output_backend(
        config.plugins.structured_output_backend, plugin_manager)
    bind = getattr(so_backend_cls, "for_plugin_manager", None)
    if bind is not None:  # a backend choosing among the registered ones (auto)
        so_backend_cls = bind(plugin_manager)
    kv_connector_cls = _resolve_kv_connector(config, scheduler_cls, plugin_manager)
    mc = config.model
    torch.manual_seed(mc.seed)  # unseeded sampling draws from the global generator
    tp_size = config.parallel.tensor_parallel_size
    num_threads = config.device.num_threads
    if tp_size > 1:
        from asyncengine.executor.parallel.group import threads_per_rank

        num_threads = threads_per_rank(config)
    device = make_device(config.device.device, num_threads)
    at_start = device.memory_at_start(config)  # before the weights: what it started from
    source = resolve_model(mc.model, config.load.load_format, mc.revision,
                           config.load.download_dir,
                           mmproj=tp_size == 1 and mc.mmproj_auto and not mc.mmproj)
    apply_hf_overrides(source.hf_config, mc.hf_overrides)  # a reranker made of a causal LM
    dtype = pick_dtype(mc.dtype, device.type)
    kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device.type)
    arch = architecture_of(source.hf_config)
    model_cls = registry.resolve_model(arch, plugin_manager)
    generation_defaults = load_generation_defaults(
        mc.generation_config, source.path, revision=mc.revision,
        overrides=mc.override_generation_config)
    parallel = None
    if tp_size > 1:
        if describe_vision(source.hf_config) is not None:
            raise ValueError("--tensor-parallel-size > 1: not for a vision-language model yet")
        from asyncengine.executor.parallel.launch import start_tensor_parallel
        from asyncengine.executor.parallel.loader import load_tp_model
        from asyncengine.executor.parallel.sharding import make_plan

        _check_family_supports(source.hf_config, "tensor_parallel", "--tensor-parallel-size")
        if arch.endswith("ForSequenceClassification"):
            raise ValueError("--tensor-parallel-size > 1: not for a classifier or reranker")
        make_plan(source.hf_config, 0, tp_size)  # an unsplittable model fails before spawning
        device.prepare_tensor_parallel(config)
        parallel = start_tensor_parallel(config, device.type)
        started.append(parallel)
        model = device.run_at_start_up(lambda: load_tp_model(
            source, config.load.load_format, dtype, device.torch_device, parallel.tp,
            seed=mc.seed, model_cls=model_cls, quantization=mc.quantization))
    else:
        model = device.run_at_start_up(lambda: load_model(
            source, config.load.load_format, dtype, device.torch_device, seed=mc.seed,
            model_cls=model_cls, quantization=mc.quantization))
    model.eval()
    # GGUF matrices: the int8 tiles from a few rows, unless drafts are verified (they need each
    # row's result the same in a 1-row step and a 1 + k row verification)
    kquants.use_few_row_tiles(model, config.speculative_settings is None)
    tokenizer = load_tokenizer(
        mc.tokenizer or source.path, gguf_file=None if mc.tokenizer else source.gguf_file,
        revision=mc.revision, chat_template=mc.chat_template)
    tokenizer.byte_pieces()  # the detokenizer's table, built now rather than at a request
    if mc.mmproj or source.mmproj:  # a GGUF model's image side (llama-server's --mmproj)
        attach_mmproj(model, mc.mmproj or source.mmproj, tokenizer, dtype, device,
                      fetched=not mc.mmproj)
    if hasattr(model, "bind_tokens"):  # a classifier's head from its vocabulary head's rows
        device.run_at_start_up(lambda: model.bind_tokens(tokenizer.hf))
    model_name = (mc.served_model_name or [source.name])[0]
    max_model_len = max_model_len_of(config, source.hf_config)
    block_size = config.cache.block_size
    shape = AttentionShape(
        num_heads=getattr(model, "num_heads", None) or source.hf_config.num_attention_heads,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, block_size=block_size,
        dtype=dtype, max_pages_per_seq=-(-max_model_len // block_size) + 1)
    attn_backend = get_attention_backend(config.device.attention_backend, device.type, shape)
    if hasattr(model, "attention_options"):
        attn_backend.configure_layers(model.attention_options())
    if hasattr(model, "configure_context"):
        model.configure_context(max_model_len)
    attn_backend = device.prepare_model(model, attn_backend, config, dtype, max_model_len)
    lora = None  # before the KV cache's size: the memory profile counts its slot tables
    if config.lora.enable_lora:
        from asyncengine.executor.lora.manager import LoRAManager

        lora = LoRAManager(model, config.lora, device.torch_device, dtype)
    num_blocks = num_kv_blocks(config, model, attn_backend, kv_dtype, device.torch_device,
                               max_model_len, at_start)
    kv_caches = device.run_at_start_up(lambda: attn_backend.allocate_kv_cache(
        model.num_layers, num_blocks, block_size, model.num_kv_heads,
        model.head_dim, kv_dtype, device.torch_device))
    attn_backend.bind_kv_cache(kv_caches)
    device.synchronize()  # weights and cache were made on the default stream
    runner_cls, runner_kwargs = ModelRunner, {}
    if parallel is not None:
        from asyncengine.executor.parallel.runner import TPModelRunner

        parallel.exchange_setup(num_blocks, max_model_len)
        runner_cls, runner_kwargs = TPModelRunner, {"tp": parallel.tp}
    runner = runner_cls(model, attn_backend, kv_caches, block_size,
                        device.torch_device, tokenizer.eos_token_ids,
                        max_num_seqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
                        staging=device.make_staging(),
                        sampling_method=device.sampling_method(model.vocab_size),
                        **runner_kwargs)
    runner.lora = lora
    if getattr(model, "vision", None) is not None:  # images: vision/, mm_step.py
        setup_vision(model, runner, config, source.path)
    if parallel is not None:  # stop the workers at exit, unless engine.shutdown() did
        atexit.register(parallel.shutdown, runner)
    # the way each phase's steps run (compiling, capturing CUDA graphs happen here)
    runner.paths = choose(PathContext(runner, device, config,
                                      tp=None if parallel is None else parallel.tp))
    kv_connector = None
    if kv_connector_cls is not None:
        layout = KVCacheLayout(
            model_identity(config, source.path, source.gguf_file), model.num_layers,
            config.cache.block_size, model.num_kv_heads, model.head_dim, kv_dtype)
        kv_connector = kv_connector_cls(config, layout)
    quant = "" if mc.quantization in ("none", "auto") else f", {mc.quantization} weights"
    if parallel is not None:
        quant += f", tensor parallel {tp_size} (rank 0's shard)"
    backends = backend_names(runner)
    cache = "" if kv_dtype == dtype else f" in {str(kv_dtype).removeprefix('torch.')}"
    logger.info("loaded %s (%s, %s%s) on %s: %d KV blocks of %d tokens%s, max_model_len %d, "
                "attention %s, sampling %s", model_name, arch, dtype, quant, device.type,
                num_blocks, block_size, cache, max_model_len, backends["attention"],
                backends["sampling"])
    return EngineParts(
        config=config, model_name=model_name, tokenizer=tokenizer,
        vocab_size=model.vocab_size, max_model_len=max_model_len, num_blocks=num_blocks,
        dtype=dtype, device=device, runner=runner, scheduler_cls=scheduler_cls,
        structured_output_backend_cls=so_backend_cls, kv_connector=kv_connector,
        generation_defaults=generation_defaults, parallel=parallel,
        sliding_window=getattr(model, "sliding_window", None))


def _resolve_kv_connector(config: EngineConfig, scheduler_cls: type,
                          plugin_manager: Any) -> type | None:
    pc = config.plugins
    if not pc.kv_connector:
        if pc.kv_connector_path:
            logger.warning("--kv-connector-path is set but no --kv-connector: ignored")
        return None
    cls = registry.resolve_kv_connector(pc.kv_connector, plugin_manager)
    setter = getattr(scheduler_cls, "set_kv_connector", None)
    if setter is None or setter is Scheduler.set_kv_connector:
        raise ValueError(f"--kv-connector: the scheduler {scheduler_cls.__name__} "
                         "does not support KV connectors")
    validate = getattr(cls, "validate_config", None)
    if validate is not None:
        validate(config)
    return cls


def _check_family_supports(hf_config: Any, path: str, flag: str) -> None:
    """ValueError naming ``flag`` when the model's family lacks ``path`` (``family.py``)."""
    from asyncengine.executor.models.family import describe

    try:
        lacks = describe(hf_config).lacks()
    except ValueError:
        return  # not a built-in family: the plugin model decides
    if path in lacks:
        raise ValueError(f"{flag}: {lacks[path]}")


def backend_names(runner: Any) -> dict[str, str]:
    """The attention and sampling backends a runner uses: the start-up log, ``/metrics``."""
    attention = getattr(getattr(runner, "attn_backend", None), "name", "unknown")
    sampling = getattr(runner, "sampling_method", None) or "torch"
    return {"attention": attention, "sampling": sampling}
