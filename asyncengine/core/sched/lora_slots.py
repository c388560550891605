"""``--max-loras`` for a scheduler: how many distinct LoRA adapters the running requests hold.

A request for an adapter already running, or for a new one while fewer than ``max_loras`` are,
may be admitted; any other waits (and later requests may pass it meanwhile). Requests without
an adapter never count.
"""

from __future__ import annotations

from asyncengine.core.request import Request


class LoRASlots:
    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras  # None: no limit (LoRA off)
        self.running: dict[bytes, int] = {}  # adapter key -> running requests

    def fits(self, request: Request) -> bool:
        """Whether ``request``'s adapter may run now."""
        running = self.running
        return (self.max_loras is None or request.lora.key in running
                or len(running) < self.max_loras)

    def enter(self, request: Request) -> None:
        key = request.lora.key
        self.running[key] = self.running.get(key, 0) + 1

    def leave(self, request: Request) -> None:
        key = request.lora.key
        left = self.running.get(key, 0) - 1
        if left > 0:
            self.running[key] = left
        else:
            self.running.pop(key, None)
