"""LLMs: several models in one process for offline use, loaded and unloaded explicitly.

    models = LLMs(models_dir="models/", max_models=2, dtype="float32")
    models.load("qwen2")                               # or on its first generate()
    outs = models.generate("llama", ["Hello"], SamplingParams(max_tokens=32))
    models.unload("llama")                             # its weights and KV cache are freed

Each model is an ``LLM`` (``engine/llm.py``) kept loaded between calls; past ``max_models``
the least recently used is unloaded. A server holds its models in a ``ModelRegistry``
(``engine/registry.py``) instead, whose engines run together on one loop; that class is the
asynchronous API for programs that run their own loop.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.catalog import ModelSource, build_catalog, engine_config
from asyncengine.engine.cycles import dispose, free
from asyncengine.engine.llm import LLM, Prompt
from asyncengine.engine.model_entry import ModelNotFound
from asyncengine.engine.outputs import RequestOutput
from asyncengine.engine.sleep import return_memory


class LLMs:
    """Models by name: those of ``models_dir`` (as a router server finds them) and those of
    ``models`` (name -> file or directory; None: the embedded model). ``kwargs`` are engine
    options for every model, by flag name."""

    def __init__(self, models: dict[str, str | None] | None = None, *,
                 models_dir: str | None = None, max_models: int = 4, **kwargs: Any) -> None:
        sources = build_catalog(models_dir, {}, embedded=False) if models_dir else []
        sources += [ModelSource(name, path) for name, path in (models or {}).items()]
        if not sources:
            raise ValueError("LLMs: give models or a models_dir holding some")
        self.sources = {s.name: s for s in sources}
        self.base = EngineConfig.from_dict(kwargs)
        self.max_models = max_models
        self._loaded: OrderedDict[str, LLM] = OrderedDict()

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    @property
    def loaded(self) -> list[str]:
        """The loaded models, least recently used first."""
        return list(self._loaded)

    def load(self, name: str) -> LLM:
        """The model's ``LLM``, loaded now if it is not (unloading the least recently used
        one past ``max_models``)."""
        source = self.sources.get(name)
        if source is None:
            raise ModelNotFound(name, self.names)
        llm = self._loaded.get(name)
        if llm is not None:
            self._loaded.move_to_end(name)
            return llm
        while self.max_models and len(self._loaded) >= self.max_models:
            self.unload(next(iter(self._loaded)))
        llm = self._loaded[name] = LLM.from_config(engine_config(self.base, source))
        return llm

    def unload(self, name: str) -> None:
        """Drop the model's engine: its weights and KV cache are freed."""
        llm = self._loaded.pop(name, None)
        if llm is not None:
            engine = llm.engine
            engine.shutdown()
            ref = weakref.ref(engine)
            dispose(engine)  # reference counting frees it (cycles.py): no full collection
            del llm, engine
            # Offline, the frames anyio.run leaves in cycles chain up to the LLM's last
            # generate() (its ``self``): a collection frees it, and no stream waits for it.
            free(ref, f"model {name}", logging.INFO)
            return_memory()

    def generate(self, name: str, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 **kwargs: Any) -> list[RequestOutput]:
        """``LLM.generate`` on the model ``name`` (loaded first when needed)."""
        return self.load(name).generate(prompts, sampling_params, **kwargs)

    def chat(self, name: str, messages: Any,
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        return self.load(name).chat(messages, sampling_params)

    def close(self) -> None:
        for name in list(self._loaded):
            self.unload(name)
