"""The Llama name of the one decoder (``decoder.py``), kept for code that imports it from here
(the tensor-parallel model, plugins subclassing it)."""

from __future__ import annotations

from asyncengine.executor.models.decoder import Attention, CausalLM, DecoderLayer
from asyncengine.executor.models.layers import FUSED_SHARDS, MLP, Embedding, Linear, RMSNorm

LlamaForCausalLM = CausalLM

__all__ = ["FUSED_SHARDS", "MLP", "Attention", "CausalLM", "DecoderLayer", "Embedding",
           "Linear", "LlamaForCausalLM", "RMSNorm"]
