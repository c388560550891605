"""Reading another server's flags on ``asyncengine serve``: a table of flags, each rewritten
to asyncengine's, accepted as ignored (with the reason), or refused (naming it). Used for
llama-server's (``llama_flags.py``) and for the vLLM flags asyncengine does not define itself
(``vllm_flags.py``). A flag asyncengine defines (``own``) is always asyncengine's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: (flag as typed, its value, the table's shared state) -> asyncengine's arguments
Rewrite = Callable[[str, str | None, dict], list[str]]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    #: "value": one; "values": every following argument not starting with "-";
    #: "optional": one of ``choices`` if it follows; "none": a switch
    arity: str
    to: Rewrite | None = None  # None: accepted and ignored, for ``why``
    why: str = ""
    choices: tuple[str, ...] = field(default=())


def to(flag: str) -> Rewrite:
    """The same value under asyncengine's ``flag``."""
    return lambda _name, value, _state: [flag, str(value)]


def refuse(why: str) -> Rewrite:
    def fail(name: str, value: str | None, _state: dict) -> list[str]:
        shown = name if value is None else f"{name} {value}"
        raise ValueError(f"{shown}: {why}")
    return fail


def rewrite(argv: Sequence[str], own: set[str], table: Sequence[Flag], origin: str,
            say: Callable[[str], None], state: dict) -> tuple[list[str], bool]:
    """``argv`` with ``table``'s flags rewritten, each said through ``say`` (``origin``: whose
    flags they are); and whether any was read."""
    by_name = {name: flag for flag in table for name in flag.names}
    out: list[str] = []
    read = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        flag = by_name.get(name) if arg.startswith("-") and name not in own else None
        if flag is None:
            out.append(arg)
            i += 1
            continue
        read = True
        value: str | None = inline if eq else None
        i += 1
        if not eq and flag.arity == "value":
            if i >= len(argv):
                raise ValueError(f"{name}: expects a value")
            value, i = argv[i], i + 1
        elif not eq and flag.arity == "values":
            values = []
            while i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])
                i += 1
            value = " ".join(values)
        elif not eq and flag.arity == "optional" and i < len(argv) and argv[i] in flag.choices:
            value, i = argv[i], i + 1
        shown = name if value is None else f"{name} {value}"
        if flag.to is None:
            say(f"{origin} flag {shown}: ignored ({flag.why})")
            continue
        new = flag.to(name, value, state)
        if new:
            say(f"{origin} flag {shown}: read as {' '.join(new)}")
        out += new
    return out, read
