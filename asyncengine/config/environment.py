"""Every environment variable asyncengine reads, in one table: its name, its default, what it
does. Flags configure a server; these are for comparisons, benchmarks and the odd machine,
and for the names other tools already use (vLLM's, PyTorch's). Code reads them through
:func:`get` / :func:`on`, so a variable not listed here cannot be read at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    # -- the executor: which kernels and paths run (comparisons; the chooser logs the result)
    Variable("ASYNCENGINE_CPU_KERNELS", "1",
             "0: none of the own C++ CPU kernels (layer ops, the decode stack, the greedy "
             "head): the PyTorch paths run"),
    Variable("ASYNCENGINE_CPU_BF16", "",
             "0: the CPU counts as lacking bfloat16 dot products (--dtype auto is then "
             "float32 everywhere, as the test suite runs)"),
    Variable("ASYNCENGINE_GREEDY_INT8", "1",
             "0: no int8 screen before the CPU's greedy head (AVX-512 VNNI)"),
    Variable("ASYNCENGINE_LORA_KERNEL", "1",
             "0: LoRA updates through PyTorch on the CPU too, not the C++ kernel"),
    Variable("ASYNCENGINE_CUDA_LAYER_OPS", "1",
             "0: no FlashInfer norm, RoPE and activation kernels on CUDA (PyTorch's ops)"),
    # -- the device runtime
    Variable("ASYNCENGINE_CUDA_AWAIT", "thread",
             "how the loop awaits a CUDA step's event: thread (a waiter thread) or poll"),
    Variable("ASYNCENGINE_CUDA_EAGER_LAUNCH", "loop",
             "where eager (not graph-replayed) CUDA steps are enqueued from: loop or thread"),
    Variable("ASYNCENGINE_LOOP_SCHED_BATCH", "1",
             "0: the event loop's thread stays SCHED_OTHER (by default SCHED_BATCH, so that "
             "waking the CPU's worker never preempts it)"),
    Variable("ASYNCENGINE_TP_TIMEOUT", "30",
             "seconds a tensor-parallel collective waits for a peer before the step fails"),
    # -- serving
    Variable("ASYNCENGINE_BATCH_SEND", "1",
             "0: every SSE write from the loop (no native sender thread)"),
    Variable("ASYNCENGINE_PLUGINS", "",
             "comma-separated entry-point names of the plugins to load (unset: all; set and "
             "empty: none but the built-ins)"),
    Variable("ASYNCENGINE_API_KEY", "", "the API key, as --api-key gives it"),
    Variable("VLLM_API_KEY", "", "the API key, under vLLM's name"),
    Variable("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "",
             "1 or true: /v1/load_lora_adapter and /v1/unload_lora_adapter are served, as "
             "--allow-runtime-lora-updating does"),
    Variable("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc",
             "the OTLP protocol of --otlp-traces-endpoint: grpc or http/protobuf (vLLM's and "
             "OpenTelemetry's name; the SDK reads its other OTEL_* variables itself)"),
    # -- the machine and other tools' names
    Variable("HF_HUB_OFFLINE", "",
             "1, on, yes or true: never reach the model hub (only its cache is read)"),
    Variable("GLIBC_TUNABLES", "",
             "when set, the CPU device leaves glibc's malloc as configured (it otherwise keeps "
             "a step's large buffers in the heap between steps)"),
    Variable("MALLOC_ARENA_MAX", "",
             "glibc's arenas at most; when set, a router keeps it (it otherwise limits them "
             "to 2: each load and unload runs in new threads)"),
    # -- files
    Variable("ASYNCENGINE_CACHE", "",
             "the cache folder (default ~/.cache/asyncengine): GGUF tokenizers converted once"),
    Variable("TORCHINDUCTOR_CACHE_DIR", "",
             "--compile's inductor caches (default ~/.cache/asyncengine/inductor)"),
    # -- benchmarks
    Variable("OPENAI_API_KEY", "", "the key `asyncengine bench serve` sends (--api-key)"),
    Variable("ASYNCENGINE_BENCH_THREADS", "0",
             "the CPU threads of `asyncengine bench overhead`'s servers (0: the default)"),
)}


def get(name: str) -> str:
    """The variable's value, else its default (an empty value counts as unset)."""
    value = os.environ.get(VARIABLES[name].name, "").strip()
    return value or VARIABLES[name].default


def is_set(name: str) -> bool:
    """Whether the variable is in the environment at all (even empty)."""
    return VARIABLES[name].name in os.environ


def on(name: str) -> bool:
    """A switch: anything but ``0`` is on."""
    return get(name) != "0"
