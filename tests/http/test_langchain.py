"""langchain-openai's ChatOpenAI against the real server: ``bind_tools`` (named, "any" and
auto; invoked and streamed) and ``with_structured_output(method="function_calling")``, whose
requests carry ``parallel_tool_calls`` and a named ``tool_choice``."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.server_utils import KEY, TOOLS_SERVER_NAMES, ServerProcess, tools_server

langchain_openai = pytest.importorskip("langchain_openai")


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"] = Field(description="the city")
    unit: Literal["C", "F"]


class GetTime(BaseModel):
    """Get the time in a time zone."""

    tz: Literal["UTC", "CET"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    server: ServerProcess = tools_server(tiny_llama)
    return langchain_openai.ChatOpenAI(base_url=server.url("/v1"), api_key=KEY,
                                       model=TOOLS_SERVER_NAMES[0], temperature=0,
                                       max_tokens=64, max_retries=0, timeout=60)


def test_bind_tools(llm):
    named = llm.bind_tools([GetWeather, GetTime], tool_choice="GetTime")
    msg = named.invoke("What time is it in Berlin?")
    [call] = msg.tool_calls
    assert call["name"] == "GetTime" and GetTime(**call["args"])
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    required = llm.bind_tools([GetWeather, GetTime], tool_choice="any",
                              parallel_tool_calls=False)
    msg = required.invoke("Weather in Oslo?")
    [call] = msg.tool_calls
    {"GetWeather": GetWeather, "GetTime": GetTime}[call["name"]](**call["args"])
    chunks = list(named.stream("What time is it in Berlin?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    [streamed] = merged.tool_calls
    assert streamed["name"] == "GetTime" and GetTime(**streamed["args"])
    # Auto: the tiny model answers in text, which comes back as content.
    auto = llm.bind_tools([GetWeather]).invoke("Hello", max_tokens=5)
    assert auto.tool_calls == [] and isinstance(auto.content, str) and auto.content


def test_with_structured_output_function_calling(llm):
    structured = llm.with_structured_output(GetWeather, method="function_calling")
    answer = structured.invoke("What is the weather like in Rome, in Fahrenheit?")
    assert isinstance(answer, GetWeather)
    raw = llm.with_structured_output(GetTime, method="function_calling", include_raw=True)
    out = raw.invoke("Time in Paris?")
    assert out["parsing_error"] is None and isinstance(out["parsed"], GetTime)
