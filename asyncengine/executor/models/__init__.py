"""Model code (the Llama family), the architecture registry and weight loading."""

from __future__ import annotations

from asyncengine.executor.models.llama import LlamaForCausalLM
from asyncengine.executor.models.loader import (
    ModelSource,
    embedded_model_path,
    load_model,
    pick_dtype,
    resolve_model,
)
from asyncengine.executor.models.registry import BUILTIN_MODELS, architecture_of

__all__ = ["BUILTIN_MODELS", "LlamaForCausalLM", "ModelSource", "architecture_of",
           "embedded_model_path", "load_model", "pick_dtype", "resolve_model"]
