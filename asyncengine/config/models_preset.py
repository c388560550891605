"""``--models-preset FILE``: per-model settings of a router server, in YAML or in
llama-server's INI.

Both forms give, per model name, engine options by their long flag names (``max-model-len``,
``dtype``, ``quantization``, ``chat-template``, ``speculative-config``, ``lora-modules``...),
plus three keys of the router's own:

- ``model``: the model's file or directory, relative to ``--models-dir`` (default: the
  section's name as discovered there);
- ``alias``: other names requests may use (a list, or comma-separated);
- ``load-on-startup``: load it when the server starts.

``mmproj`` (a GGUF model's vision projector file) is relative to ``--models-dir`` too.

llama-server's short and long names are read for the common ones (``c`` / ``ctx-size`` as
``max-model-len``, ``chat-template-file`` as ``chat-template``, ``np`` / ``parallel`` as
``max-num-seqs``); its ``version`` key and its ``[*]`` section (defaults for every model) are
understood. Keys that only tune llama.cpp (``n-gpu-layers``, ``flash-attn``, ``jinja``...)
are accepted and ignored, as on its command line.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: llama-server's names -> the engine option they set.
_RENAMES = {"c": "max_model_len", "ctx_size": "max_model_len", "np": "max_num_seqs",
            "parallel": "max_num_seqs", "chat_template_file": "chat_template",
            "t": "num_threads", "threads": "num_threads", "b": "max_num_batched_tokens",
            "batch_size": "max_num_batched_tokens", "a": "alias"}
#: llama-server's keys that change nothing here (as on its command line).
_IGNORED = frozenset({"n_gpu_layers", "ngl", "flash_attn", "fa", "jinja", "ubatch_size", "ub",
                      "mlock", "no_mmap", "cont_batching", "cb", "threads_http", "temp",
                      "top_k", "top_p", "min_p", "presence_penalty", "repeat_penalty",
                      "cache_reuse", "no_webui", "numa", "version"})
_ROUTER_KEYS = frozenset({"model", "alias", "load_on_startup"})


@dataclass
class ModelPreset:
    """One model's settings from the preset file."""

    name: str
    model: str | None = None
    aliases: list[str] = field(default_factory=list)
    load_on_startup: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # engine options, flat names


def load_presets(path: str | Path) -> dict[str, ModelPreset]:
    """The presets of ``path`` by model name (YAML by extension ``.yaml``/``.yml``, else INI).
    A ValueError naming ``--models-preset`` when the file cannot be read."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"--models-preset: cannot read {path}: {e.strerror or e}") from None
    sections = _yaml(text, path) if p.suffix.lower() in (".yaml", ".yml") else _ini(text, path)
    defaults = sections.pop("*", {})
    return {name: _preset(name, {**defaults, **values}, path)
            for name, values in sections.items()}


def _yaml(text: str, path: str | Path) -> dict[str, dict[str, Any]]:
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--models-preset: {path} is not valid YAML: {e}") from None
    data = data.get("models", data) if isinstance(data, dict) else data
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"--models-preset: {path} must map model names to mappings of "
                         "options")
    return {str(k): dict(v) for k, v in data.items()}


def _ini(text: str, path: str | Path) -> dict[str, dict[str, Any]]:
    parser = configparser.ConfigParser(interpolation=None, default_section="\0none")
    try:
        # llama-server's files start with keys outside any section (``version = 1``)
        parser.read_string(f"[{_TOP}]\n{text}", str(path))
    except configparser.Error as e:
        raise ValueError(f"--models-preset: {path} is not a valid INI file: "
                         f"{str(e).splitlines()[0]}") from None
    return {name: dict(parser[name]) for name in parser.sections() if name != _TOP}


_TOP = "\x01top"


def _preset(name: str, values: dict[str, Any], path: str | Path) -> ModelPreset:
    preset = ModelPreset(name)
    for raw, value in values.items():
        key = str(raw).strip().lstrip("-").replace("-", "_")
        key = _RENAMES.get(key, key)
        if key in _IGNORED:
            continue
        if key == "model":
            preset.model = str(value)
        elif key == "alias":
            items = value if isinstance(value, list) else str(value).split(",")
            preset.aliases = [str(a).strip() for a in items if str(a).strip()]
        elif key == "load_on_startup":
            preset.load_on_startup = _bool(value, name, path)
        else:
            preset.options[key] = _scalar(value)
    return preset


def _bool(value: Any, name: str, path: str | Path) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"--models-preset: {path}: [{name}] load-on-startup must be true or "
                     f"false, got {value!r}")


def _scalar(value: Any) -> Any:
    """INI values are strings: numbers and booleans as such, the rest as given."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
