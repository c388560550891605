"""``qwen3``: Qwen3 (and QwQ-style templates). Reasoning is only what stands inside
``<think>`` ... ``</think>``: an output without a start tag is all content, and with
``chat_template_kwargs: {"enable_thinking": false}`` the template writes an empty, closed
``<think>\\n\\n</think>`` into the prompt, so the whole output is content. A template that
opens ``<think>`` in the prompt (Qwen3's 2507 thinking models) starts the output inside it."""

from __future__ import annotations

from asyncengine.text.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_start = False
