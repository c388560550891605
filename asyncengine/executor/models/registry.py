"""The built-in model architectures, by the names found in ``config.json`` ``architectures``."""

from __future__ import annotations

from typing import Any

from asyncengine.executor.models.llama import LlamaForCausalLM

BUILTIN_MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3, SmolLM/SmolLM2
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

# Configs converted from GGUF carry a model_type but no architectures list.
_ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def architecture_of(config: Any) -> str:
    """The architecture name of a transformers config (``LlamaForCausalLM``, ...)."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", "")
    return _ARCH_OF_MODEL_TYPE.get(model_type, model_type or "<unknown>")
