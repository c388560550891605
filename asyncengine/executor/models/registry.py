"""The built-in model architectures, by the names found in ``config.json`` ``architectures``.

All of them are the one decoder (``decoder.py``) reading a family description
(``family.py``); the ``*ForSequenceClassification`` ones put a classification head on it
(``classifier.py``)."""

from __future__ import annotations

from typing import Any

from asyncengine.executor.models.classifier import SequenceClassifier
from asyncengine.executor.models.decoder import CausalLM
from asyncengine.executor.models.vision_lm import VisionLM

BUILTIN_MODELS: dict[str, type] = {
    "LlamaForCausalLM": CausalLM,  # Llama 2/3, SmolLM/SmolLM2
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": CausalLM,
    "Gemma2ForCausalLM": CausalLM,
    "Gemma3ForCausalLM": CausalLM,  # Gemma 3 1B (text only)
    "Gemma3ForConditionalGeneration": VisionLM,  # Gemma 3 4B+: SigLIP, the projector, Gemma 3
    "Phi3ForCausalLM": CausalLM,  # Phi-3, Phi-3.5, Phi-4-mini
    "LlavaForConditionalGeneration": VisionLM,  # LLaVA-1.5: CLIP, the MLP projector, Llama
    "LlavaNextForConditionalGeneration": VisionLM,  # LLaVA-NeXT: anyres tiles, image_newline
    "Idefics3ForConditionalGeneration": VisionLM,  # SigLIP tiles, the pixel-shuffle connector
    "SmolVLMForConditionalGeneration": VisionLM,  # SmolVLM: Idefics3's, on SmolLM2
    "Qwen2VLForConditionalGeneration": VisionLM,  # dynamic resolution, the merger, M-RoPE
    "Qwen2_5_VLForConditionalGeneration": VisionLM,  # and window attention in the tower
    "Qwen3VLForConditionalGeneration": VisionLM,  # deepstack, interleaved M-RoPE, Qwen3
    "MixtralForCausalLM": CausalLM,
    "Qwen2MoeForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
    # Sequence classifiers and cross-encoders: the decoder with a ``score`` head.
    "LlamaForSequenceClassification": SequenceClassifier,
    "MistralForSequenceClassification": SequenceClassifier,
    "Qwen2ForSequenceClassification": SequenceClassifier,
    "Qwen3ForSequenceClassification": SequenceClassifier,  # and Qwen3-Reranker (--hf-overrides)
    "Gemma2ForSequenceClassification": SequenceClassifier,
    "Gemma3TextForSequenceClassification": SequenceClassifier,
    "Phi3ForSequenceClassification": SequenceClassifier,
    "MixtralForSequenceClassification": SequenceClassifier,
    "Qwen2MoeForSequenceClassification": SequenceClassifier,
    "Qwen3MoeForSequenceClassification": SequenceClassifier,
}

# Configs converted from GGUF carry a model_type but no architectures list.
_ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2_vl_text": "Qwen2ForCausalLM",  # (a qwen2vl GGUF's decoder; images: --mmproj)
    "qwen3_vl_text": "Qwen3ForCausalLM",  # (a qwen3vl GGUF's)
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def architecture_of(config: Any) -> str:
    """The architecture name of a transformers config (``LlamaForCausalLM``, ...)."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", "")
    return _ARCH_OF_MODEL_TYPE.get(model_type, model_type or "<unknown>")
