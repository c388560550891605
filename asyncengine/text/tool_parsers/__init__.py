"""Tool-call parsers: the model's output text -> content and tool calls (streamed).

``--tool-call-parser NAME`` picks one of ``TOOL_PARSERS`` for ``tool_choice: "auto"``;
``forced`` reads the outputs a grammar shaped (``"required"``, a named function).
"""

from __future__ import annotations

from asyncengine.text.tool_parsers.base import (
    CallDelta,
    ParsedDelta,
    ParsedOutput,
    ToolCallInfo,
    ToolParser,
)
from asyncengine.text.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from asyncengine.text.tool_parsers.hermes import HermesToolParser
from asyncengine.text.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r} (known: "
                         f"{', '.join(sorted(TOOL_PARSERS))})") from None


__all__ = ["CallDelta", "HermesToolParser", "Llama3JsonToolParser", "NamedFunctionParser",
           "ParsedDelta", "ParsedOutput", "RequiredCallsParser", "TOOL_PARSERS", "ToolCallInfo",
           "ToolParser", "get_tool_parser"]
