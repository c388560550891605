"""The decode stack's parameter structs, read from the C++ header that declares them.

``kernels/stack_layout.h`` lists each struct's fields once, in X-macros; this module parses
that file into ``ctypes`` structures of the same fields (and its ``#define`` constants), and
:func:`check` compares the layout the compiled stack reports (``ae_stack_layout``: each
struct's size and field offsets) with these, raising on any difference, so that the two
sides cannot drift: a field added on one side only fails the load, loudly.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import torch

from asyncengine.executor.kernels.build import kernel_dir

HEADER = "stack_layout.h"
_TYPES = {"int64_t": ctypes.c_int64, "double": ctypes.c_double}
_DEFINE = re.compile(r"^#define (AE_\w+) (\d+)\b", re.M)
_FIELDS = re.compile(r"^#define AE_(\w+)_FIELDS\(F, A, S\)((?:.*\\\n)*.*)$", re.M)
_ENTRY = re.compile(r"([FAS])\((\w+), (\w+)(?:, (\w+))?\)")
_STRUCT = re.compile(r"^struct (\w+) \{ AE_(\w+)_FIELDS\(", re.M)


def parse(text: str) -> tuple[dict[str, int], dict[str, type[ctypes.Structure]]]:
    """The header's integer constants and its structs, in the order it declares them."""
    consts = {name: int(value) for name, value in _DEFINE.findall(text)}
    bodies = {name: re.sub(r"/\*.*?\*/", " ", body, flags=re.S)
              for name, body in _FIELDS.findall(text)}
    structs: dict[str, type[ctypes.Structure]] = {}
    for struct, macro in _STRUCT.findall(text):
        fields: list[tuple[str, Any]] = []
        declared: list[str] = []
        for kind, ctype, name, count in _ENTRY.findall(bodies[macro]):
            if kind == "S":
                fields.append((name, structs[ctype]))
            elif kind == "A":
                fields.append((name, _TYPES[ctype] * consts[count]))
            else:
                fields.append((name, _TYPES[ctype]))
            declared.append(f"{ctype} {name}[{count}]" if kind == "A" else f"{ctype} {name}")
        structs[struct] = type(struct, (ctypes.Structure,),
                               {"_fields_": fields, "declared": declared})
    return consts, structs


def _fnv(text: str) -> int:
    """stack_layout.h's ae_fnv: FNV-1a over the bytes, as an int64."""
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) % 2**64
    return h - 2**64 if h >= 2**63 else h


CONSTS, STRUCTS = parse((Path(kernel_dir()) / HEADER).read_text())
AeNorm, AeProj, AeLayer, AeModel, AeStep = (
    STRUCTS[n] for n in ("AeNorm", "AeProj", "AeLayer", "AeModel", "AeStep"))


def expected_layout(structs: dict[str, type[ctypes.Structure]] = STRUCTS) -> list[int]:
    """What ``ae_stack_layout`` writes for ``structs``: per struct, in the header's order, its
    size, then per field the hash of its declaration and its offset."""
    out: list[int] = []
    for cls in structs.values():
        out.append(ctypes.sizeof(cls))
        for (name, _), declared in zip(cls._fields_, cls.declared, strict=True):
            out += [_fnv(declared), getattr(cls, name).offset]
    return out


def check(fn: Any, structs: dict[str, type[ctypes.Structure]] = STRUCTS) -> None:
    """Ask the compiled stack ``fn`` its layout; RuntimeError unless it is that of
    ``structs`` (this module's)."""
    want = expected_layout(structs)
    got = torch.full((len(want) + 256,), -1, dtype=torch.int64)  # room for more fields
    fn(0, 0, got.data_ptr())
    reported = got[:int((got != -1).nonzero().max()) + 1].tolist()
    if reported != want:
        raise RuntimeError(f"the decode stack's structs as compiled ({reported}) differ "
                           f"from {HEADER} as Python reads it ({want}): rebuild, or fix the "
                           "parser in paths/stack_layout.py")


def address(obj: ctypes.Structure | ctypes.Array) -> int:
    """Where ``obj`` is, for the kernel's arguments and the structs' pointers (keep ``obj``)."""
    return ctypes.addressof(obj)
