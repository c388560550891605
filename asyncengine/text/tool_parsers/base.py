"""The tool-parser contract: model output text in, content and tool calls out, streamed.

A parser reads one sample's output as it is generated: ``feed(delta_text)`` returns what the
caller can send now (plain content, the start of a call with its name, fragments of a call's
arguments), ``finish()`` what was held back at the end. ``parse(text)`` runs the same on a
whole output, so a streamed response and a non-streamed one always agree. Parsers are pure
text: they know nothing of tokens, HTTP or the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from asyncengine.text.tool_parsers.json_call import JsonCallReader


@dataclass
class CallDelta:
    """A piece of tool call ``index``: its ``name`` on its first piece, then ``arguments``
    text to append (OpenAI's ``delta.tool_calls[i]``)."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        for c in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == c.index and c.name is None:
                last.arguments += c.arguments
            else:
                self.calls.append(CallDelta(c.index, c.name, c.arguments))


@dataclass
class ToolCallInfo:
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ToolCallInfo]


class ToolParser(ABC):
    """One sample's output. Subclasses read their model family's call format."""

    #: The ``--tool-call-parser`` value.
    name: str = ""

    def __init__(self) -> None:
        self.failed = False  # the output broke the format (a non-streamed parse keeps it as text)
        self._calls: list[JsonCallReader] = []
        self._sent_args: list[int] = []
        self._sent_name: list[bool] = []

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Read more output; what can be sent now."""

    def finish(self) -> ParsedDelta:
        """The output ended: what was held back."""
        return ParsedDelta()

    @property
    def made_calls(self) -> bool:
        """Whether a call was sent (its name at least)."""
        return any(self._sent_name)

    @property
    def incomplete(self) -> bool:
        """A call was begun and never closed."""
        return any(not c.done for c in self._calls)

    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once: its content (None when empty) and its calls. Output that
        breaks the format, or ends inside a call, is all content (as vLLM's parsers do)."""
        out = self.feed(text)
        out.extend(self.finish())
        if self.failed or self.incomplete:
            return ParsedOutput(text or None, [])
        calls = [ToolCallInfo(c.name or "", c.arguments) for c in self._calls]
        return ParsedOutput(out.content or None, calls)

    # -- helpers for subclasses ----------------------------------------------------------------
    def _new_call(self) -> JsonCallReader:
        reader = JsonCallReader()
        self._calls.append(reader)
        self._sent_args.append(0)
        self._sent_name.append(False)
        return reader

    def _read_call(self, text: str, out: ParsedDelta) -> int:
        """Feed the current call; add its new pieces to ``out``; the characters used."""
        i = len(self._calls) - 1
        reader = self._calls[i]
        used = reader.feed(text)
        if reader.failed:
            self.failed = True
            return used
        if reader.name is None:
            return used  # arguments wait for the name
        piece = CallDelta(i)
        if not self._sent_name[i]:
            piece.name, self._sent_name[i] = reader.name, True
        new = reader.arguments[self._sent_args[i]:]
        # A JSON-string argument value is only known once complete.
        if new:
            piece.arguments = new
            self._sent_args[i] = len(reader.arguments)
        if piece.name is not None or piece.arguments:
            out.calls.append(piece)
        return used


def held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (to hold
    back rather than send as content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
