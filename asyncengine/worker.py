"""EngineWorker: builds what runs the model — weights, tokenizer, KV cache, device, runner —
and the components chosen by name in the config (scheduler, structured-output backend, KV
connector)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from asyncengine.config import EngineConfig, parse_size
from asyncengine.device import make_device
from asyncengine.kernels import get_attention_backend
from asyncengine.kv_connector import KVCacheLayout, KVConnector, model_identity
from asyncengine.runner import ModelRunner
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduling import SchedulerInterface

logger = logging.getLogger("asyncengine")

CPU_KV_CACHE_DEFAULT = 1 << 30  # 1 GiB: ~45k tokens of the embedded model in bfloat16

T = TypeVar("T")


class EngineWorker:
    def __init__(self, config: EngineConfig, plugin_manager: Any = None) -> None:
        from asyncengine.models.loader import load_model, pick_dtype, resolve_model
        from asyncengine.models.registry import architecture_of
        from asyncengine.tokenization import load_tokenizer

        self.config = config
        self.plugin_manager = plugin_manager
        # Components named in the config are resolved (and contract-checked) before the slow
        # part, so a typo in --scheduler fails at once.
        self.scheduler_cls = self._resolve("scheduler", config.scheduler.scheduler)
        self.structured_output_backend_cls = self._resolve(
            "structured_output_backend", config.plugins.structured_output_backend)
        self.kv_connector_cls = self._resolve_kv_connector()
        mc = config.model
        torch.manual_seed(mc.seed)  # unseeded sampling draws from the global generator
        self.device = make_device(config.device.device, config.device.num_threads)
        source = resolve_model(mc.model, config.load.load_format, mc.revision,
                               config.load.download_dir)
        self.hf_config = source.hf_config
        self.dtype = pick_dtype(mc.dtype, self.device.type)
        arch = architecture_of(source.hf_config)
        model_cls = self._resolve("model", arch)
        self.model = self._off_the_loop_thread(
            lambda: load_model(source, config.load.load_format, self.dtype,
                               self.device.torch_device, seed=mc.seed, model_cls=model_cls,
                               quantization=mc.quantization))
        self.model.eval()
        self.vocab_size: int = self.model.vocab_size
        self.tokenizer = load_tokenizer(
            mc.tokenizer or source.path,
            gguf_file=None if mc.tokenizer else source.gguf_file,
            revision=mc.revision, chat_template=mc.chat_template)
        self.model_name = mc.served_model_name or source.name
        self.max_model_len = self._max_model_len()
        self.attn_backend = get_attention_backend(config.device.attention_backend,
                                                  self.device.type)
        self.num_blocks = self._num_blocks()
        m = self.model
        kv_caches = self._off_the_loop_thread(lambda: self.attn_backend.allocate_kv_cache(
            m.num_layers, self.num_blocks, config.cache.block_size, m.num_kv_heads, m.head_dim,
            self.dtype, self.device.torch_device))
        self.runner = ModelRunner(m, self.attn_backend, kv_caches, config.cache.block_size,
                                  self.device.torch_device, self.tokenizer.eos_token_ids)
        self.kv_connector: KVConnector | None = None
        if self.kv_connector_cls is not None:
            layout = KVCacheLayout(
                model_identity(config, source.path, source.gguf_file), m.num_layers,
                config.cache.block_size, m.num_kv_heads, m.head_dim, self.dtype)
            self.kv_connector = self.kv_connector_cls(config, layout)
        quant = "" if mc.quantization == "none" else f", {mc.quantization} weights"
        logger.info("loaded %s (%s, %s%s) on %s: %d KV blocks of %d tokens, max_model_len %d",
                    self.model_name, arch, self.dtype, quant, self.device.type, self.num_blocks,
                    config.cache.block_size, self.max_model_len)

    def _off_the_loop_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a thread that ends when it returns, on the CPU.

        OpenMP gives every thread that runs a parallel region its own team of threads, kept
        until that thread exits. The forward pass runs on the device's worker thread; had the
        loop's thread (this one) started a team too, the two teams would overcommit the cores
        and libgomp would put idle team threads to sleep after very short spins: measured on
        2 cores, every parallel kernel then pays a wake-up, and a batch-1 decode step of
        SmolLM2-135M takes ~26 ms instead of ~18 ms. Loading the weights and filling the KV
        cache are the parallel work done at start-up, so they run here.
        """
        if self.device.type != "cpu":
            return fn()
        with ThreadPoolExecutor(1, thread_name_prefix="asyncengine-load") as pool:
            return pool.submit(fn).result()

    # -- components chosen by name ----------------------------------------------------------------
    def _resolve(self, kind: str, name: str) -> Any:
        from asyncengine import registry

        resolve = {"model": registry.resolve_model, "scheduler": registry.resolve_scheduler,
                   "structured_output_backend": registry.resolve_structured_output_backend,
                   "kv_connector": registry.resolve_kv_connector}[kind]
        return resolve(name, self.plugin_manager)

    def _resolve_kv_connector(self) -> Any:
        pc = self.config.plugins
        if not pc.kv_connector:
            if pc.kv_connector_path:
                logger.warning("--kv-connector-path is set but no --kv-connector: ignored")
            return None
        cls = self._resolve("kv_connector", pc.kv_connector)
        setter = getattr(self.scheduler_cls, "set_kv_connector", None)
        if setter is None or setter is SchedulerInterface.set_kv_connector:
            raise ValueError(f"--kv-connector: the scheduler {self.scheduler_cls.__name__} "
                             "does not support KV connectors")
        validate = getattr(cls, "validate_config", None)
        if validate is not None:
            validate(self.config)
        return cls

    def make_scheduler(self) -> SchedulerInterface:
        config = self.config.replace(max_model_len=self.max_model_len)
        scheduler = self.scheduler_cls(config, self.num_blocks)
        if self.kv_connector is not None:
            scheduler.set_kv_connector(self.kv_connector)
        return scheduler

    def make_structured_output_manager(self) -> Any:
        from asyncengine.structured_output import StructuredOutputManager

        backend = self.structured_output_backend_cls(self.tokenizer, self.vocab_size)
        return StructuredOutputManager(backend)

    def make_detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> Any:
        from asyncengine.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer.from_params(self.tokenizer, prompt_token_ids, params)

    # -- sizes ------------------------------------------------------------------------------------
    def _max_model_len(self) -> int:
        native = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        # Attention here is full, never windowed: a sliding-window model is exact only within
        # its window.
        window = getattr(self.model, "sliding_window", None)
        if window:
            native = min(native, window)
        wanted = self.config.model.max_model_len
        if wanted is None:
            return min(native, 8192)
        if wanted > native:
            raise ValueError(f"--max-model-len {wanted} exceeds the model's context length "
                             f"({native})")
        return wanted

    def _num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        m = self.model
        per_block = self.attn_backend.bytes_per_block(m.num_layers, cc.block_size,
                                                      m.num_kv_heads, m.head_dim, self.dtype)
        if cc.kv_cache_memory != "auto":
            budget = parse_size(cc.kv_cache_memory, "kv_cache_memory")
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            budget = int(free * 0.9)
        else:
            budget = CPU_KV_CACHE_DEFAULT
        num_blocks = budget // per_block
        needed = -(-self.max_model_len // cc.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"--kv-cache-memory: {budget} bytes hold {num_blocks} blocks of {cc.block_size} "
                f"tokens, fewer than one full-length request needs ({needed} blocks for "
                f"--max-model-len {self.max_model_len}); raise it or lower --max-model-len")
        return num_blocks
