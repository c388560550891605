"""What the handlers share: the engine, the metrics, the settings, the draining flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncengine.entrypoints.http.logprobs import TokenTexts

if TYPE_CHECKING:
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.entrypoints.http.sender import BatchSender

DEFAULT_MAX_REQUEST_BODY = 16 * 2**20
#: OpenAI's limit on a batch's input file.
DEFAULT_MAX_BATCH_FILE_SIZE = 200 * 2**20


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # X-Tenant is taken with --api-key only under --trust-tenant-header (tenancy.py).
    trust_tenant_header: bool = False
    shutdown_timeout: float = 30.0
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY
    access_log: bool = True
    # CORS (vLLM's defaults: everything allowed, no credentials).
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # TLS
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # A proxy's path prefix ("" or "/prefix"): routes answer with and without it.
    root_path: str = ""
    # Tools: tool_choice "auto" parses the output with this parser (see text/tool_parsers).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    log_requests: bool = False
    # The chat page at / (web.py); --no-web-ui turns it off.
    web_ui: bool = True
    # Reasoning models: --reasoning-parser (a registered name; see text/reasoning_parsers).
    reasoning_parser: str | None = None
    # --default-chat-template-kwargs: what each request's chat_template_kwargs start from.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # vLLM's usage options: the prefix cache's share of the prompt in usage; usage at the end
    # of every stream, asked for or not.
    prompt_tokens_details: bool = False
    force_include_usage: bool = False
    # The Batch API (entrypoints/batch): where files and batches live (None: a temporary
    # directory), the largest upload, the most batch lines in flight (None: the default).
    batch_dir: str | None = None
    max_batch_file_size: int = DEFAULT_MAX_BATCH_FILE_SIZE
    max_batch_concurrency: int | None = None
    # Router mode (router.py): the directory models are loaded from (None: one model), and
    # whether /sleep, /wake_up and /is_sleeping answer (--enable-sleep-mode).
    models_dir: str | None = None
    sleep_mode: bool = False


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: EngineMetrics | None
    settings: ServerSettings
    # Set on SIGINT/SIGTERM: new requests get 503 while the in-flight ones finish.
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Sends pushed SSE frames off the loop (sender.py); None until started, or where it
    # cannot run.
    sender: BatchSender | None = None
    # Router mode: the models (engine/registry.py); ``engine`` is then None on the app's
    # state and each routed request gets a state bound to its model's engine.
    registry: Any = None

    @property
    def token_texts(self) -> TokenTexts:
        return self.engine.tokenizer.token_texts

    @property
    def reasoning_parser(self) -> type | None:
        """The --reasoning-parser class (None: outputs are not split)."""
        name = self.settings.reasoning_parser
        if not name:
            return None
        from asyncengine.ext.registry import resolve_reasoning_parser

        return resolve_reasoning_parser(name)

    @property
    def served_model_names(self) -> list[str]:
        if self.engine is None and self.registry is not None:
            return self.registry.names()
        return served_model_names(self.engine)

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the generation config (--generation-config)."""
        parts = getattr(self.engine, "parts", None)
        return getattr(parts, "generation_defaults", None) or {}


def served_model_names(engine: AsyncEngine) -> list[str]:
    """Every name clients may send as ``model`` (--served-model-name a b ...); the first is
    the one responses and metrics carry."""
    names = getattr(getattr(getattr(engine, "config", None), "model", None),
                    "served_model_name", None)
    return list(names) if names else [engine.model_name]


STATE = web.AppKey("asyncengine_state", ServerState)
#: Router mode: the request's state, bound to the engine of the model it names (router.py).
ROUTED: Any = (web.RequestKey("asyncengine_routed", ServerState)
               if hasattr(web, "RequestKey") else "asyncengine_routed")  # aiohttp < 3.12


def state_of(request: web.Request) -> ServerState:
    routed = request.get(ROUTED)
    return request.app[STATE] if routed is None else routed
