"""Reading flag and YAML values: flag names, JSON objects, sizes, flat or nested mappings."""

from __future__ import annotations

import json
import re
from typing import Any

from asyncengine.config.sections import SECTIONS


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def json_object(value: Any, name: str) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag(name)}: must be a JSON object, got {value!r}")
    return parsed


def flatten(data: dict[str, Any]) -> dict[str, Any]:
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
        raise ValueError(f"{flag(name)}: cannot read {text!r} as a size (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])
