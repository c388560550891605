"""The model: one decoder (``decoder.py``) read off a family description (``family.py``), its
building blocks (``layers.py``, ``rope.py``, ``moe.py``), pooling for embeddings, and the
architecture registry. How weights get into it is ``executor/weights/``; which way a step runs
through it is ``executor/paths/``."""

from __future__ import annotations

from asyncengine.executor.models.decoder import CausalLM
from asyncengine.executor.models.family import ModelSpec, describe
from asyncengine.executor.models.llama import LlamaForCausalLM
from asyncengine.executor.models.registry import BUILTIN_MODELS, architecture_of

__all__ = ["BUILTIN_MODELS", "CausalLM", "LlamaForCausalLM", "ModelSpec", "architecture_of",
           "describe"]
