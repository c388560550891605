"""An incremental reader of ONE JSON tool-call object, ``{"name": "f", "arguments": {...}}``.

Models write a call as a JSON object with the function's name and its arguments (Hermes and
Qwen: ``"arguments"``; Llama 3: ``"parameters"``). Streaming needs the name as soon as it is
complete and the arguments' text as it arrives, so this reads the object character by
character, tracking only what it must: the top-level keys, string and escape state, and the
nesting depth. The arguments are kept as the model wrote them (raw JSON text), so the
fragments a stream sends concatenate to exactly the string a non-streamed response holds; an
argument object the model wrote as a JSON string is decoded once complete.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"
NAME_KEYS = frozenset({"name"})
ARGUMENT_KEYS = frozenset({"arguments", "parameters"})


class JsonCallReader:
    """Feed text with ``feed``; it stops at the object's closing brace. ``name`` is set once
    the name string is complete; ``arguments`` grows as the arguments' text arrives (a JSON
    string value appears whole, decoded, when it ends). ``failed`` on invalid JSON."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""
        self.done = False
        self.failed = False
        self._started = False
        self._phase = "key"  # at depth 1: key | colon | value | comma
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._buf: list[str] = []  # the current key, or the value being captured
        self._key: str | None = None
        self._value_started = False
        self._value_is_string = False
        self._value_primitive = False

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the end of the object; the number of characters used."""
        for i, c in enumerate(text):
            if self.done or self.failed:
                return i
            self._step(c)
        if (self._phase == "value" and self._value_started and self._key in ARGUMENT_KEYS
                and not self._value_is_string):
            self.arguments = "".join(self._buf)
        return len(text)

    # -- the state machine --------------------------------------------------------------------
    def _step(self, c: str) -> None:
        if not self._started:
            if c == "{":
                self._started, self._depth = True, 1
            elif c not in _WS:
                self.failed = True
            return
        phase = self._phase
        if phase == "value":
            self._value_char(c)
        elif phase == "key":
            self._key_char(c)
        elif phase == "colon":
            if c == ":":
                self._phase, self._value_started, self._buf = "value", False, []
            elif c not in _WS:
                self.failed = True
        elif phase == "comma":
            self._after_value(c)

    def _key_char(self, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._key = _loads_string("".join(self._buf))
                self._phase = "colon" if self._key is not None else self._fail()
                return
            self._buf.append(c)
        elif c == '"':
            self._in_string, self._buf = True, []
        elif c == "}" and self._key is None:  # {}
            self._finish()
        elif c not in _WS:
            self.failed = True

    def _value_char(self, c: str) -> None:
        if not self._value_started:
            if c in _WS:
                return
            self._value_started = True
            self._value_is_string = c == '"'
            self._value_primitive = c not in '"{['
            self._in_string = self._value_is_string
            if c in "{[":
                self._depth += 1
            self._buf.append(c)
            return
        if self._in_string:
            self._buf.append(c)
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:  # the value itself was a string
                    self._end_value()
            return
        if self._value_primitive:
            if c in _WS or c in ",}":
                self._end_value()
                self._after_value(c)
            else:
                self._buf.append(c)
            return
        self._buf.append(c)
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_value()

    def _end_value(self) -> None:
        raw = "".join(self._buf)
        if self._key in NAME_KEYS:
            self.name = _loads_string(raw[1:-1]) if self._value_is_string else None
            if self.name is None:
                self.failed = True
        elif self._key in ARGUMENT_KEYS:
            if self._value_is_string:  # arguments sent as a JSON-encoded string
                decoded = _loads_string(raw[1:-1])
                if decoded is None:
                    self.failed = True
                self.arguments = decoded or ""
            else:
                self.arguments = raw
        self._phase, self._buf = "comma", []

    def _after_value(self, c: str) -> None:
        if c == ",":
            self._phase, self._key = "key", ""  # a key must follow (no "}" after a comma)
        elif c == "}":
            self._finish()
        elif c not in _WS:
            self.failed = True

    def _finish(self) -> None:
        self._depth = 0
        self.done = True
        if self.name is None:
            self.failed = True
        elif not self.arguments:
            self.arguments = "{}"

    def _fail(self) -> str:
        self.failed = True
        return "key"


def _loads_string(inner: str) -> str | None:
    try:
        value = json.loads(f'"{inner}"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None
