"""A model of the router's registry (``engine/registry.py``): its status, its engine, its
leases; and the errors a lookup or a load gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import anyio

from asyncengine.engine.catalog import ModelSource
from asyncengine.engine.sleep import KVSleep


class ModelStatus(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"
    FAILED = "failed"


class ModelNotFound(LookupError):
    """A name the registry does not know; ``available`` lists the ones it does."""

    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(f"The model `{name}` does not exist (available: "
                         f"{', '.join(f'`{n}`' for n in available) or 'none'}).")
        self.name = name
        self.available = available


class ModelUnavailable(RuntimeError):
    """A known model that cannot serve now: not loaded with autoload off, a load that failed
    (the message names the file and the reason), a memory budget too small for it."""

    def __init__(self, message: str, *, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class ModelEntry:
    source: ModelSource
    status: ModelStatus = ModelStatus.UNLOADED
    engine: Any = None
    error: str | None = None
    sleep_level: int = 0
    last_used: float = 0.0
    leases: int = 0
    memory: int = 0  # bytes: the estimate while loading, then what the engine holds
    busy: str | None = None  # the transition running: "loading", "unloading", ...
    extras: dict[str, Any] = field(default_factory=dict)  # per engine; dropped with it
    _settled: anyio.Event = field(default_factory=anyio.Event)
    _idle: anyio.Event = field(default_factory=anyio.Event)
    _stop: anyio.Event | None = None
    _host_done: anyio.Event | None = None
    _kv: KVSleep | None = None

    @property
    def name(self) -> str:
        return self.source.name

    def load_failure(self) -> ModelUnavailable:
        """The error of the requests that waited for a load that failed."""
        return ModelUnavailable(f"The model `{self.name}` failed to load: {self.error}",
                                status=load_status(self.error))

    @property
    def resident(self) -> bool:
        """Whether it holds memory (or is about to): counted against ``max_models``."""
        return self.status in (ModelStatus.LOADED, ModelStatus.LOADING) or (
            self.status == ModelStatus.SLEEPING and self.sleep_level == 1)


def where(entry: ModelEntry) -> str:
    return f"`{entry.name}` ({entry.source.path or 'the embedded model'})"


def reason(entry: ModelEntry, error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if entry.source.path and entry.source.path not in text:
        text = f"{entry.source.path}: {text}"
    return text


def load_status(error: str | None) -> int:
    """A load that failed for the model's own files or options is the server's problem
    (a 500 naming the file), one refused by the memory budget is a 507-like refusal (503)."""
    return 503 if error and "--models-memory" in error else 500


def adapter_names(source: ModelSource) -> list[str]:
    """The LoRA adapters a model's options name (``lora_modules``: ``name=path`` or vLLM's
    JSON objects)."""
    from asyncengine.config.sections import parse_lora_module

    modules = source.options.get("lora_modules") or []
    if isinstance(modules, str | dict):
        modules = [modules]
    return [parse_lora_module(m)[0] for m in modules]
