"""``llama3_json``: Llama 3.1+ with JSON-based tool calling answers either plain text or,
for a call, only JSON (optionally after ``<|python_tag|>``)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several calls separated by ``;``. Output that does not start with ``{`` is content.
"""

from __future__ import annotations

from asyncengine.text.tool_parsers.base import ParsedDelta, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode = "undecided"  # undecided | content | call | between

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf:
            if self._mode == "content" or self.failed:
                out.content += self._buf
                self._buf = ""
            elif self._mode == "undecided":
                head = self._buf.lstrip()
                if head.startswith(PYTHON_TAG):
                    head = head[len(PYTHON_TAG):].lstrip()
                if not head or PYTHON_TAG.startswith(head):
                    break  # only whitespace (or part of the tag) so far
                if head[0] == "{":
                    self._buf, self._mode = head, "call"
                    self._new_call()
                else:
                    self._mode = "content"
            elif self._mode == "call":
                used = self._read_call(self._buf, out)
                self._buf = self._buf[used:]
                if self._calls[-1].done:
                    self._mode = "between"
                elif not self.failed:
                    break
            else:  # between calls: whitespace, ";" then the next call
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                if stripped[0] != ";":
                    self.failed = True
                    continue
                rest = stripped[1:].lstrip()
                if not rest:
                    self._buf = stripped  # wait for the next call
                    break
                self._buf, self._mode = rest, "call"
                self._new_call()
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "undecided":
            out.content, self._buf = self._buf, ""
        elif self._mode == "call":
            self.failed = True
        return out
