"""LoRA adapters at runtime: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's).

Both answer only when runtime updating is enabled (``--allow-runtime-lora-updating`` or
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) on an engine with ``--enable-lora``; otherwise a
404 that says how to enable them. Success is vLLM's plain-text 200.
"""

from __future__ import annotations

from aiohttp import web

from asyncengine.config import environment
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.protocol import Body, Count
from asyncengine.entrypoints.http.serving import read_body, served_model_names
from asyncengine.entrypoints.http.state import state_of

ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(Body, kw_only=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(Body, kw_only=True):
    lora_name: str
    lora_int_id: Count | None = None  # vLLM's; unused (adapters are named)


def runtime_updating(engine) -> bool:
    lc = getattr(getattr(engine, "config", None), "lora", None)
    flag = bool(lc is not None and lc.allow_runtime_lora_updating)
    return flag or environment.get(ENV).lower() in ("1", "true")


def updating_enabled(engine) -> bool:
    """Whether the load/unload routes answer (/openapi.json lists them only then)."""
    return getattr(engine, "lora", None) is not None and runtime_updating(engine)


def _check_enabled(request: web.Request):
    engine = state_of(request).engine
    if getattr(engine, "lora", None) is None:
        raise APIError(404, "LoRA adapters are not enabled on this server (start it with "
                            "--enable-lora).")
    if not runtime_updating(engine):
        raise APIError(404, "Loading and unloading LoRA adapters at runtime is disabled "
                            "(start the server with --allow-runtime-lora-updating, or with "
                            f"{ENV}=True).")
    return engine


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = _check_enabled(request)
    body = await read_body(request, LoadLoRAAdapterRequest)
    if not body.lora_name or not body.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if body.lora_name in served_model_names(engine) or body.lora_name in engine.lora_names():
        raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.",
                          "lora_name")
    try:
        await engine.load_lora_adapter(body.lora_name, body.lora_path)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = _check_enabled(request)
    body = await read_body(request, UnloadLoRAAdapterRequest)
    try:
        engine.unload_lora_adapter(body.lora_name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                       param="lora_name", code="model_not_found") from None
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
