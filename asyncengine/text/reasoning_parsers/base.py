"""The reasoning-parser contract: a reasoning model's output text in, its thinking span and its
answer out, streamed.

A reasoning model writes its thinking between tags (``<think>`` ... ``</think>``) before the
answer. A parser reads one sample's output as it is generated: ``feed(delta_text)`` returns
the reasoning and the content the caller can send now, ``finish()`` what was held back (a tag
split across tokens is held until it is known). ``parse(text)`` runs the same over a whole
output, so a streamed response and a non-streamed one always agree. Parsers are text only;
``count_reasoning_tokens`` reads token ids for usage.

The tags the prompt already holds decide the start: a prompt that ends inside an open
``<think>`` (a template that opens it for the model) starts the output in the reasoning; a
prompt whose last tag is a closing ``</think>`` (``enable_thinking: false`` in Qwen3's
template) makes the whole output the answer.

Subclasses set ``name`` (the ``--reasoning-parser`` value), the tags, and
``implicit_start``: whether an output whose prompt holds no tag starts in the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncengine.text.tool_parsers.base import held_prefix

#: The version of this contract (a plugin's parser may declare ``contract_version``).
REASONING_PARSER_API_VERSION = 1


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def extend(self, other: ReasoningDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


@dataclass
class ReasoningOutput:
    reasoning: str | None
    content: str | None


class ReasoningParser:
    """One sample's output. The state machine is the same for every tag-based parser:
    ``before`` (content; a start tag begins the reasoning), ``reasoning`` (until the end tag),
    ``answer`` (everything is content)."""

    #: The ``--reasoning-parser`` value.
    name: str = ""
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    #: With no tag in the prompt, the output starts in the reasoning (DeepSeek-R1: its
    #: template may open ``<think>`` itself, or the model may leave the start tag out).
    implicit_start: bool = False

    def __init__(self, prompt: str = "") -> None:
        self._buf = ""
        self._state = self.initial_state(prompt)
        # At the start of a reasoning span a start tag the model writes anyway is dropped.
        self._at_span_start = self._state == "reasoning"

    # -- the prompt -----------------------------------------------------------------------------
    @classmethod
    def initial_state(cls, prompt: str) -> str:
        """``before``, ``reasoning`` or ``answer``: where the output begins, given the
        rendered prompt's last tag."""
        start, end = prompt.rfind(cls.start_tag), prompt.rfind(cls.end_tag)
        if end >= 0 and end > start:
            return "answer"  # the template closed the reasoning: thinking is off
        if start >= 0:
            return "reasoning"  # the template opened it
        return "reasoning" if cls.implicit_start else "before"

    @classmethod
    def reasoning_ended_in_prompt(cls, prompt: str) -> bool:
        return cls.initial_state(prompt) == "answer"

    # -- streaming --------------------------------------------------------------------------
    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    @property
    def ended(self) -> bool:
        """The answer has begun (the reasoning ended, or never was)."""
        return self._state == "answer"

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buf += text
        while self._buf:
            if self._state == "answer":
                out.content += self._buf
                self._buf = ""
            elif self._state == "before":
                at = self._buf.find(self.start_tag)
                if at < 0:
                    keep = held_prefix(self._buf, self.start_tag)
                    out.content += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.content += self._buf[:at]
                self._buf = self._buf[at + len(self.start_tag):]
                self._state, self._at_span_start = "reasoning", False
            else:  # reasoning
                if self._at_span_start:
                    if self.start_tag.startswith(self._buf):
                        if len(self._buf) < len(self.start_tag):
                            break  # could still be the start tag
                    self._at_span_start = False
                    if self._buf.startswith(self.start_tag):
                        self._buf = self._buf[len(self.start_tag):]
                        continue
                at = self._buf.find(self.end_tag)
                if at < 0:
                    keep = held_prefix(self._buf, self.end_tag)
                    out.reasoning += self._buf[:len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.reasoning += self._buf[:at]
                self._buf = self._buf[at + len(self.end_tag):]
                self._state = "answer"
        return out

    def finish(self) -> ReasoningDelta:
        """The output ended: what was held back goes where it stood (an unclosed reasoning
        span, max_tokens reached inside it, stays reasoning)."""
        out = ReasoningDelta()
        if self._buf:
            if self._state == "reasoning":
                out.reasoning = self._buf
            else:
                out.content = self._buf
            self._buf = ""
        return out

    def parse(self, text: str) -> ReasoningOutput:
        out = self.feed(text)
        out.extend(self.finish())
        return ReasoningOutput(out.reasoning or None, out.content or None)

    # -- tokens ---------------------------------------------------------------------------------
    @classmethod
    def count_reasoning_tokens(cls, prompt: str, token_ids: list[int], start_ids: list[int],
                               end_ids: list[int]) -> int:
        """How many of the output's tokens are reasoning (the tags themselves not counted):
        the tags are found as token-id sequences (``start_ids``/``end_ids``: the tags
        tokenized, one id each in real reasoning models)."""
        state = cls.initial_state(prompt)
        if state == "answer":
            return 0
        begin = 0
        if state == "before":
            at = _find(token_ids, start_ids, 0)
            if at < 0:
                return 0
            begin = at + len(start_ids)
        elif start_ids and token_ids[:len(start_ids)] == start_ids:
            begin = len(start_ids)
        end = _find(token_ids, end_ids, begin)
        return (len(token_ids) if end < 0 else end) - begin


def _find(seq: list[int], sub: list[int], start: int) -> int:
    if not sub:
        return -1
    n = len(sub)
    for i in range(start, len(seq) - n + 1):
        if seq[i] == sub[0] and seq[i:i + n] == sub:
            return i
    return -1
