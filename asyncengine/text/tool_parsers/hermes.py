"""``hermes``: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

after optional plain content. Text before the first call is the content; whitespace between
and after calls is dropped.
"""

from __future__ import annotations

from asyncengine.text.tool_parsers.base import ParsedDelta, ToolParser, held_prefix

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._state = "content"  # content | call | close

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf:
            if self.failed:  # the rest is plain text
                out.content += self._buf
                self._buf = ""
            elif self._state == "content":
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = held_prefix(self._buf, OPEN)
                    send = self._buf[:len(self._buf) - keep]
                    if not self._calls:  # content after the first call is dropped
                        out.content += send
                    self._buf = self._buf[len(send):]
                    break
                if not self._calls:
                    out.content += self._buf[:at]
                self._buf = self._buf[at + len(OPEN):]
                self._new_call()
                self._state = "call"
            elif self._state == "call":
                used = self._read_call(self._buf, out)
                self._buf = self._buf[used:]
                if self._calls[-1].done:
                    self._state = "close"
                elif not self.failed:
                    break
            else:  # after a call: whitespace, then </tool_call>
                stripped = self._buf.lstrip()
                if stripped.startswith(CLOSE):
                    self._buf = stripped[len(CLOSE):]
                    self._state = "content"
                elif CLOSE.startswith(stripped):
                    break  # wait for more
                else:
                    self.failed = True
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == "content" and not self._calls:
            out.content, self._buf = self._buf, ""
        elif self._state == "call":
            self.failed = True
        return out
