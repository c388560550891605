"""Reasoning parsers: a reasoning model's output -> its thinking span and its answer (streamed).

``--reasoning-parser NAME`` picks one; the built-ins (``deepseek_r1``, ``qwen3``) are
registered by ``asyncengine.builtins`` through the ``register_reasoning_parsers`` hook, so a
plugin can add its own (``asyncengine.ext.registry.resolve_reasoning_parser``).
"""

from __future__ import annotations

from asyncengine.text.reasoning_parsers.base import (
    REASONING_PARSER_API_VERSION,
    ReasoningDelta,
    ReasoningOutput,
    ReasoningParser,
)
from asyncengine.text.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from asyncengine.text.reasoning_parsers.qwen3 import Qwen3ReasoningParser

BUILTIN_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}

__all__ = ["BUILTIN_REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
           "REASONING_PARSER_API_VERSION", "ReasoningDelta", "ReasoningOutput",
           "ReasoningParser"]
