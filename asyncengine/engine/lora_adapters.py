"""The engine's LoRA adapters (``--enable-lora``): which are served, loading and unloading
them while the engine runs (vLLM's ``/v1/load_lora_adapter``). ``AsyncEngine`` inherits
these; the adapters themselves live in the runner (``executor/lora/manager.LoRAManager``)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from asyncengine.core.request import LoRARequest


class LoRAAdapters:
    runner: Any  # AsyncEngine's

    @property
    def lora(self) -> Any:
        """The adapters' registry (``executor/lora/manager.LoRAManager``), None without
        --enable-lora."""
        return self.runner.lora

    def lora_names(self) -> list[str]:
        return [] if self.lora is None else list(self.lora.adapters)

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` runs with (None: the base model); ValueError when unknown."""
        if name is None:
            return None
        if self.lora is None:
            from asyncengine.executor.lora.manager import LoRANotFound

            raise LoRANotFound(f"The model `{name}` does not exist (LoRA adapters are not "
                               "enabled: --enable-lora).")
        return self.lora.request(name)

    async def load_lora_adapter(self, name: str, path: str,
                                base_model_name: str | None = None) -> None:
        """Read the PEFT adapter at ``path`` (off the loop) and serve it as ``name``.
        ValueError: LoRA not enabled, the name taken, or the adapter unreadable or too big."""
        lora = self.lora
        if lora is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        if name in lora.adapters:
            raise ValueError(f"The LoRA adapter `{name}` is already loaded.")
        weights, key = await anyio.to_thread.run_sync(lora.read, path)
        lora.register(name, path, weights, key, base_model_name)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``; KeyError when unknown. Requests already queued with it
        finish with it."""
        if self.lora is None:
            raise KeyError(name)
        self.lora.unregister(name)
