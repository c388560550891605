"""Router mode's flags (llama-server's names) and sleep mode's (vLLM's, llama-server's)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from asyncengine.config import parse_size

DEFAULT_MODELS_MAX = 4


@dataclass
class RouterSettings:
    models_dir: str | None = None
    models_preset: str | None = None
    models_max: int = DEFAULT_MODELS_MAX
    autoload: bool = True
    memory_budget: int | None = None
    sleep_mode: bool = False
    sleep_idle_s: float | None = None
    unload_timeout: float | None = None  # None: --shutdown-timeout


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "Router", "several models in one server, loaded on demand (llama-server's router "
        "mode); sleep mode (vLLM's)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model of DIR (.gguf files, checkpoint directories), each "
                        "request routed by its `model` and loaded on its first request")
    g.add_argument("--models-preset", default=None, metavar="FILE",
                   help="per-model settings, YAML or llama-server's INI: aliases, context, "
                        "dtype, quantization, chat template... (docs/serving.md)")
    g.add_argument("--models-max", type=int, default=DEFAULT_MODELS_MAX, metavar="N",
                   help="most models loaded at once; past it the least recently used is "
                        f"unloaded (default: {DEFAULT_MODELS_MAX}; 0: no limit)")
    g.add_argument("--models-autoload", dest="models_autoload", action="store_true",
                   default=True, help="load a model on its first request (the default)")
    g.add_argument("--no-models-autoload", dest="models_autoload", action="store_false",
                   help="load models only through POST /models/load")
    g.add_argument("--models-memory", default=None, metavar="SIZE",
                   help="memory the loaded models may hold together, e.g. 8GiB: checked "
                        "before a load, unloading the least recently used ones")
    g.add_argument("--models-unload-timeout", type=float, default=None, metavar="S",
                   help="an unloaded (or sleeping) model's running requests get S seconds to "
                        "finish, then end with an error (default: --shutdown-timeout; 0: at "
                        "once)")
    g.add_argument("--enable-sleep-mode", action="store_true",
                   help="POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (vLLM's)")
    g.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="S",
                   help="a model idle for S seconds sleeps (level 1) until its next request "
                        "(llama-server's)")


def router_settings(args: argparse.Namespace) -> RouterSettings | None:
    """The router's settings, or None for a one-model server. ValueError names the flag."""
    models_dir = getattr(args, "models_dir", None)
    preset = getattr(args, "models_preset", None)
    sleep_mode = getattr(args, "enable_sleep_mode", False)
    idle = getattr(args, "sleep_idle_seconds", None)
    if not (models_dir or preset or sleep_mode or idle is not None):
        return None
    if models_dir and getattr(args, "model", None):
        raise ValueError(f"--models-dir: give either a model ({args.model!r}) or a directory "
                         "of models, not both")
    if models_dir and not os.path.isdir(models_dir):
        raise ValueError(f"--models-dir: {models_dir} is not a directory")
    if preset and not os.path.isfile(preset):
        raise ValueError(f"--models-preset: file not found: {preset}")
    if args.models_max < 0:
        raise ValueError(f"--models-max: must be 0 (no limit) or more, got {args.models_max}")
    if idle is not None and idle <= 0:
        raise ValueError(f"--sleep-idle-seconds: must be positive, got {idle}")
    budget = None if args.models_memory is None else parse_size(args.models_memory,
                                                                "models_memory")
    unload_timeout = getattr(args, "models_unload_timeout", None)
    if unload_timeout is not None and unload_timeout < 0:
        raise ValueError(f"--models-unload-timeout: must be 0 or more, got {unload_timeout}")
    return RouterSettings(models_dir=models_dir, models_preset=preset,
                          models_max=args.models_max, autoload=args.models_autoload,
                          memory_budget=budget, sleep_mode=sleep_mode, sleep_idle_s=idle,
                          unload_timeout=unload_timeout)
