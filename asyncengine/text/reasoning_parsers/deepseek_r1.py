"""``deepseek_r1``: DeepSeek-R1 and its distills. The reasoning comes first, ended by
``</think>``; the start tag is optional, since R1's template opens ``<think>`` in the prompt
(and older templates let the model write it): text before ``</think>`` is reasoning even
without a start tag. An output that never closes it (max_tokens reached) is all reasoning."""

from __future__ import annotations

from asyncengine.text.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True
