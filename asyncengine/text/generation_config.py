"""Server-side sampling defaults from a model's ``generation_config.json`` (vLLM's
``--generation-config``).

A request that leaves ``temperature`` (``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, the chat ``max_tokens``) unset gets the model creator's recommended
value instead of OpenAI's default, as vLLM does:

* ``auto`` (default): the model's own ``generation_config.json``;
* ``vllm``: none (OpenAI's and vLLM's defaults);
* a directory: its ``generation_config.json``.

Like transformers' ``GenerationConfig.to_diff_dict``, only values that differ from
transformers' defaults count (``top_k: 50`` is its default, so it sets nothing).
``--override-generation-config '{"temperature": 0.5}'`` goes on top.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("asyncengine")

FILE = "generation_config.json"
#: The sampling fields used, with transformers' GenerationConfig defaults (not overrides).
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                "repetition_penalty": 1.0, "max_new_tokens": None}


def load_generation_defaults(setting: str, model_path: str | None, *,
                             revision: str | None = None,
                             overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults (``SamplingParams`` names: ``max_new_tokens`` becomes
    ``max_tokens``). Raises ValueError naming the flag for a directory without the file."""
    config: dict[str, Any] = {}
    if setting == "auto":
        file = _find(model_path, revision) if model_path else None
        if file is not None:
            config = _read(file, "--generation-config")
    elif setting != "vllm":
        file = Path(setting) / FILE
        if not file.is_file():
            raise ValueError(f"--generation-config: no {FILE} in {setting!r} (give a directory "
                             "holding one, or auto, or vllm)")
        config = _read(str(file), "--generation-config")
    defaults = {k: v for k, v in config.items()
                if k in _HF_DEFAULTS and v is not None and v != _HF_DEFAULTS[k]}
    for k, v in (overrides or {}).items():
        if k not in _HF_DEFAULTS:
            raise ValueError(f"--override-generation-config: unknown key {k!r} (known: "
                             f"{', '.join(_HF_DEFAULTS)})")
        defaults[k] = v
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        logger.info("default sampling parameters from the generation config: %s (a request "
                    "that sets one wins; --generation-config vllm turns this off)", defaults)
    return defaults


def _find(path: str, revision: str | None) -> str | None:
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    local = os.path.join(directory, FILE)
    if os.path.isfile(local):
        return local
    if os.path.exists(path):  # a local file (GGUF) or directory without one
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, FILE, revision=revision)
    except Exception:  # not a hub id, or no cache
        return None
    return found if isinstance(found, str) else None


def _read(file: str, flag: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read {file}: {e}") from None
    return data if isinstance(data, dict) else {}
