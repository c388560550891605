"""What the handlers share: the engine, the metrics, the settings, the draining flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from asyncengine.entrypoints.http.logprobs import TokenTexts

if TYPE_CHECKING:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.metrics import EngineMetrics

DEFAULT_MAX_REQUEST_BODY = 16 * 2**20


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    shutdown_timeout: float = 30.0
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    access_log: bool = True


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: EngineMetrics | None
    settings: ServerSettings
    # Set on SIGINT/SIGTERM: new requests get 503 while the in-flight ones finish.
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def token_texts(self) -> TokenTexts:
        return self.engine.tokenizer.token_texts


STATE = web.AppKey("asyncengine_state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
