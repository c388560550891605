"""Reading outputs whose shape a grammar forced (``tool_choice`` "required" or a named
function; see ``entrypoints/http/tools.py`` for the schemas):

* a named function: the whole output is the arguments object;
* "required": a JSON array of ``{"name": ..., "arguments": {...}}`` objects, one per call.
"""

from __future__ import annotations

from asyncengine.text.tool_parsers.base import (
    CallDelta,
    ParsedDelta,
    ParsedOutput,
    ToolCallInfo,
    ToolParser,
)


class NamedFunctionParser(ToolParser):
    """The output is the arguments of ``function``: one call, streamed as it comes."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function
        self._started = False
        self._arguments = ""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not text:
            return out
        self._arguments += text
        piece = CallDelta(0, arguments=text)
        if not self._started:
            piece.name, self._started = self.function, True
        out.calls.append(piece)
        return out

    @property
    def made_calls(self) -> bool:
        return self._started

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(None, [ToolCallInfo(self.function, text)])


class RequiredCallsParser(ToolParser):
    """``[{"name": "f", "arguments": {...}}, ...]``, each call streamed as it comes."""

    name = "required"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._state = "open"  # open | call | between | closed

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf and not self.failed:
            if self._state == "call":
                used = self._read_call(self._buf, out)
                self._buf = self._buf[used:]
                if not self._calls[-1].done:
                    break
                self._state = "between"
                continue
            stripped = self._buf.lstrip()
            if not stripped:
                self._buf = ""
                break
            c, self._buf = stripped[0], stripped[1:]
            if self._state == "open" and c == "[":
                self._state = "first"
            elif self._state == "first" and c == "]":
                self._state = "closed"
            elif self._state in ("first", "next") and c == "{":
                self._new_call()
                self._buf = c + self._buf
                self._state = "call"
            elif self._state == "between" and c == ",":
                self._state = "next"
            elif self._state == "between" and c == "]":
                self._state = "closed"
            else:
                self.failed = True
        return out

    def finish(self) -> ParsedDelta:
        if self._state != "closed":
            self.failed = True
        return ParsedDelta()
