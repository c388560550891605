"""asyncengine: an LLM inference and serving engine built around one event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from asyncengine.engine.outputs import CompletionOutput, RequestOutput
from asyncengine.ext import deprecated as _deprecated
from asyncengine.ext.contracts.hooks import hookimpl

_deprecated.install()  # the plugin API's old module paths, for one more version

__version__ = "0.1.0"

if TYPE_CHECKING:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.engine.llm import LLM
    from asyncengine.engine.llms import LLMs


def __getattr__(name: str):  # heavy imports (torch) only when used
    if name == "AsyncEngine":
        from asyncengine.engine.engine import AsyncEngine

        return AsyncEngine
    if name == "LLM":
        from asyncengine.engine.llm import LLM

        return LLM
    if name == "LLMs":
        from asyncengine.engine.llms import LLMs

        return LLMs
    raise AttributeError(name)


__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "LLM", "LLMs", "RequestOutput",
           "RequestOutputKind",
           "SamplingParams", "StructuredOutputsParams", "__version__", "hookimpl"]
