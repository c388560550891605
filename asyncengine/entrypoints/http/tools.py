"""Tool calling, shared by /v1/chat/completions and /v1/responses.

``plan_tools`` turns a request's ``tools`` and ``tool_choice`` into what the server does:

* ``"none"`` (or no tools): plain text; the tools still reach the chat template.
* ``"auto"``: the model decides; its output is read by the ``--tool-call-parser`` parser
  (needs ``--enable-auto-tool-choice``, as in vLLM).
* ``"required"``: the output is forced, through the structured-output backend, to be a
  JSON array of ``{"name": ..., "arguments": {...}}`` objects, one per call, whose arguments
  follow the named function's ``parameters`` schema (at most one call with
  ``parallel_tool_calls: false``).
* a named function: the output is forced to be that function's arguments object.

Forced calls always parse and validate against the function's parameters (a grammar makes
any other output impossible), unless generation stops at ``max_tokens`` first.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncengine.core.sampling_params import StructuredOutputsParams
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.protocol import ChatTool, NamedToolChoice, ToolChoice
from asyncengine.entrypoints.http.state import ServerSettings
from asyncengine.text.tool_parsers import (
    NamedFunctionParser,
    ParsedOutput,
    RequiredCallsParser,
    ToolParser,
    get_tool_parser,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a request's tools mean for generation and for reading its output."""

    template_tools: list[dict[str, Any]] | None = None  # for the chat template
    structured_outputs: StructuredOutputsParams | None = None  # "required" / named
    make_parser: Callable[[], ToolParser] | None = None  # None: the output is plain text

    def parse(self, text: str) -> ParsedOutput:
        if self.make_parser is None:
            return ParsedOutput(text, [])
        return self.make_parser().parse(text)


def plan_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None,
               parallel_tool_calls: bool | None, settings: ServerSettings) -> ToolPlan:
    """Raise ``APIError`` (400) naming the parameter for an invalid combination."""
    if tools is None:
        if tool_choice is not None and tool_choice != "none":
            raise bad_request("tool_choice is only allowed when tools are specified",
                              "tool_choice")
        return ToolPlan()
    if not tools:
        raise bad_request("tools must hold at least one tool (or be left out)", "tools")
    by_name = {t.function.name: t for t in tools}
    plan = ToolPlan(template_tools=template_tools(tools))
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in by_name:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in "
                              f"tools ({', '.join(by_name)})", "tool_choice")
        plan.structured_outputs = StructuredOutputsParams(
            json=by_name[name].function.parameters or _ANY_OBJECT)
        plan.make_parser = lambda: NamedFunctionParser(name)
    elif choice == "required":
        plan.structured_outputs = StructuredOutputsParams(
            json=required_schema(tools, parallel_tool_calls is not False))
        plan.make_parser = RequiredCallsParser
    elif choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set on the server (or send "
                              'tool_choice "required", "none" or a named function)',
                              "tool_choice")
        plan.make_parser = get_tool_parser(settings.tool_call_parser)
    return plan


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (transformers' ``tools=``)."""
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in (
        ("name", t.function.name), ("description", t.function.description),
        ("parameters", t.function.parameters or _ANY_OBJECT)) if v is not None}}
        for t in tools]


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``"required"`` output: an array of calls of the given tools."""
    calls = [{"type": "object",
              "properties": {"name": {"enum": [t.function.name]},
                             "arguments": t.function.parameters or _ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_no_other_format(plan: ToolPlan, structured: StructuredOutputsParams | None) -> None:
    if plan.structured_outputs is not None and structured is not None:
        raise APIError(400, "tool_choice \"required\" or a named function cannot be combined "
                            "with response_format or structured_outputs", param="tool_choice")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's ``"tool_calls"`` when the output ended normally with calls."""
    return "tool_calls" if made_calls and reason == "stop" else reason
