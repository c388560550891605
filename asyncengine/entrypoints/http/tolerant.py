"""Decoding request bodies the way OpenAI's and vLLM's servers do: unknown fields are
accepted and ignored, and the server logs each ignored field name once.

msgspec ignores unknown fields itself; to name them, the decoded JSON is compared with the
Struct's type information (``msgspec.inspect``), walking only into the values whose type is
a Struct (or a list or union of Structs): free-form dicts are not visited. The same walk
holds the body to what /openapi.json says: a JSON number with an integral value (``2.0``,
``1e3``) is an integer, as JSON Schema counts it, and a tagged object (a content part) must
carry its tag, which msgspec alone would let a lone tagged Struct leave out.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

logger = logging.getLogger("asyncengine.entrypoints.http")

T = TypeVar("T")

_logged: set[str] = set()
#: Names remembered at most (clients could send endless distinct names).
MAX_LOGGED = 1024


def decode(data: bytes, type_: type[T]) -> T:
    """The body as ``type_``; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    obj = msgspec.json.decode(data)
    unknown: list[str] = []
    _walk(obj, _info(type_), "$.", unknown)
    for name in unknown:
        if name not in _logged and len(_logged) < MAX_LOGGED:
            _logged.add(name)
            name = name.removeprefix("$.")
            logger.warning("ignoring the request field %r: not used by this server (logged once "
                           "per field name)", name)
    return msgspec.convert(obj, type_)


@functools.lru_cache(maxsize=64)
def _info(type_: type) -> mi.Type:
    return mi.type_info(type_)


def _walk(obj: Any, t: mi.Type, path: str, out: list[str]) -> None:
    if isinstance(t, mi.UnionType):
        t = _pick(obj, t)
        if t is None:
            return
    if isinstance(t, mi.StructType):
        if not isinstance(obj, dict):
            return
        if t.tag_field is not None and t.tag_field not in obj:
            raise msgspec.ValidationError(f"Object missing required field `{t.tag_field}` - "
                                          f"at `{path.rstrip('.')}`")
        fields = _fields(t)
        for key, value in obj.items():
            f = fields.get(key)
            if f is not None:
                if isinstance(value, float) and _wants_int(f):
                    obj[key] = value = _integral(value)
                _walk(value, f, f"{path}{key}.", out)
            elif key != t.tag_field:
                out.append(f"{path}{key}")
    elif isinstance(t, mi.ListType) and isinstance(obj, list):
        item = t.item_type
        if _wants_int(item) or _wants_int_list(item):
            for i, value in enumerate(obj):
                if isinstance(value, float):
                    obj[i] = _integral(value)
                elif isinstance(value, list) and _wants_int_list(item):
                    obj[i] = [_integral(v) if isinstance(v, float) else v for v in value]
        elif _has_struct(item):
            for value in obj:
                _walk(value, item, path, out)


def _integral(value: float) -> int | float:
    """``value`` as an int when it is one (JSON Schema's integers include ``2.0``)."""
    return int(value) if value.is_integer() else value


def _members(t: mi.Type) -> tuple[mi.Type, ...]:
    return t.types if isinstance(t, mi.UnionType) else (t,)


def _wants_int(t: mi.Type) -> bool:
    """True when ``t`` takes an int and no float: an integral float should become an int."""
    members = _members(t)
    return (any(isinstance(m, mi.IntType) for m in members)
            and not any(isinstance(m, mi.FloatType) for m in members))


def _wants_int_list(t: mi.Type) -> bool:
    return any(isinstance(m, mi.ListType) and _wants_int(m.item_type) for m in _members(t))


def _pick(obj: Any, t: mi.UnionType) -> mi.Type | None:
    """The member of a union that ``obj`` decodes as (by tag for tagged Structs)."""
    if isinstance(obj, dict):
        for member in t.types:
            if isinstance(member, mi.StructType):
                if member.tag_field is None or obj.get(member.tag_field) == member.tag:
                    return member
        for member in t.types:  # a tagged object without its tag: _walk refuses it
            if isinstance(member, mi.StructType) and member.tag_field not in obj:
                return member
    elif isinstance(obj, list):
        for member in t.types:
            if isinstance(member, mi.ListType):
                return member
    return None


_FIELDS: dict[type, dict[str, mi.Type]] = {}


def _fields(t: mi.StructType) -> dict[str, mi.Type]:
    fields = _FIELDS.get(t.cls)
    if fields is None:
        fields = _FIELDS[t.cls] = {f.encode_name: f.type for f in t.fields}
    return fields


def _has_struct(t: mi.Type) -> bool:
    if isinstance(t, mi.StructType):
        return True
    if isinstance(t, mi.UnionType):
        return any(_has_struct(m) for m in t.types)
    if isinstance(t, mi.ListType):
        return _has_struct(t.item_type)
    return False
