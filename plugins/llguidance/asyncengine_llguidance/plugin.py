"""The module the entry point names; the backend (and llguidance) load on first lookup."""

from __future__ import annotations

from asyncengine.plugins import Register, hookimpl


@hookimpl
def register_structured_output_backends(register: Register) -> None:
    from asyncengine_llguidance.backend import LLGuidanceBackend

    register("llguidance", LLGuidanceBackend)
