"""The server's own flags (vLLM's "Frontend" group) and the settings made from them.

The engine's flags come from ``entrypoints/flags/engine.py``. vLLM's names are used where
they exist; flags that only tune vLLM's own machinery are accepted and documented as no-ops
(docs/serving.md, "Coming from vLLM").
"""

from __future__ import annotations

import argparse
import json
import os

from asyncengine.config import environment, parse_size
from asyncengine.entrypoints.flags.batch import add_batch_arguments, batch_settings
from asyncengine.entrypoints.flags.router import add_router_arguments
from asyncengine.entrypoints.http.state import DEFAULT_MAX_REQUEST_BODY, ServerSettings
from asyncengine.text.tool_parsers import TOOL_PARSERS

#: Where the API key comes from when --api-key is not given, in order.
API_KEY_ENVS = ("ASYNCENGINE_API_KEY", "VLLM_API_KEY")
API_KEY_ENV = API_KEY_ENVS[0]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
HTTP_LOG_LEVELS = (*LOG_LEVELS, "trace")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Frontend", "the HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on "
                   "every route but /health, /ping, /metrics and the chat page's files (default: "
                   f"${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]})")
    g.add_argument("--trust-tenant-header", action="store_true",
                   help="with --api-key, take each request's tenant (for fair-share "
                        "scheduling) from its X-Tenant header, as a gateway in front that "
                        "authenticates callers sets it; without this flag a keyed server "
                        "ignores the header and the key is the tenant")
    g.add_argument("--allowed-origins", default=None, metavar="LIST",
                   help="CORS: origins allowed, a JSON list or comma-separated (default: *)")
    g.add_argument("--allowed-methods", default=None, metavar="LIST",
                   help="CORS: methods allowed (default: *)")
    g.add_argument("--allowed-headers", default=None, metavar="LIST",
                   help="CORS: request headers allowed (default: *)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="TLS: the certificate chain (PEM)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="TLS: CA certificates to verify client certificates with")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="TLS: client certificates: 0 none, 1 optional, 2 required (default: 0)")
    g.add_argument("--root-path", default="", help="the path prefix a proxy serves this "
                   "server under, e.g. /llm: routes answer with and without it")
    g.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                   help="do not serve the chat page at / (its assets under /webui/)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls from the output with '
                        "--tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the format of the model's tool calls (hermes: Qwen2.5/Qwen3, "
                        "Hermes; llama3_json: Llama 3.1+)")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a reasoning model's thinking from its answer: the thinking "
                        "goes to message.reasoning (and reasoning_content); deepseek_r1 "
                        "(DeepSeek-R1 and distills), qwen3 (Qwen3, QwQ), or one a plugin "
                        "registers")
    g.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help='chat_template_kwargs every request starts from, e.g. '
                        '\'{"enable_thinking": false}\' (a request\'s own override them)')
    g.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGINT/SIGTERM, "
                   "seconds in-flight requests get to finish before they are aborted "
                   "(default: 30)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="log level (default: info)")
    g.add_argument("--uvicorn-log-level", default=None, choices=HTTP_LOG_LEVELS,
                   help="log level of the HTTP server's own loggers (aiohttp.*; default: "
                        "--log-level)")
    g.add_argument("--max-request-body", default=None, help="largest request body, e.g. "
                   "16MiB; larger ones get 413 (default: 16MiB)")
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log",
                   dest="disable_access_log", action="store_true",
                   help="do not log one line per HTTP request")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each generation request (id, prompt length, parameters)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log requests (the default; accepted for vLLM compatibility)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted for vLLM compatibility (no periodic stats log here)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="accepted for vLLM compatibility: X-Request-Id is always echoed")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt's tokens "
                        "found in the prefix cache (chat and completions)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every chat and completions stream ends with a usage chunk, as if "
                        "it asked with stream_options.include_usage")
    add_batch_arguments(parser)
    add_router_arguments(parser)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Raise ValueError naming the flag for a bad value."""
    max_body = args.max_request_body
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout: must be non-negative, got {args.shutdown_timeout}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port: must be in 0..65535, got {args.port}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')}: file not found: {path}")
    root = (args.root_path or "").rstrip("/")
    if root and not root.startswith("/"):
        raise ValueError(f"--root-path: must start with '/', got {args.root_path!r}")
    reasoning_parser = getattr(args, "reasoning_parser", None)
    if reasoning_parser:
        from asyncengine.ext.registry import resolve_reasoning_parser

        resolve_reasoning_parser(reasoning_parser)  # ValueError names --reasoning-parser
    template_kwargs = _json_object(getattr(args, "default_chat_template_kwargs", None),
                                   "default_chat_template_kwargs")
    api_key = args.api_key or next((environment.get(e) for e in API_KEY_ENVS
                                    if environment.get(e)), None)
    return ServerSettings(
        host=args.host,
        port=args.port,
        api_key=api_key or None,
        trust_tenant_header=getattr(args, "trust_tenant_header", False),
        shutdown_timeout=args.shutdown_timeout,
        max_request_body=(DEFAULT_MAX_REQUEST_BODY if max_body is None
                          else parse_size(max_body, "max_request_body")),
        access_log=not args.disable_access_log,
        allowed_origins=_list(args.allowed_origins, "allowed_origins"),
        allowed_methods=_list(args.allowed_methods, "allowed_methods"),
        allowed_headers=_list(args.allowed_headers, "allowed_headers"),
        allow_credentials=args.allow_credentials,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        root_path=root,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
        web_ui=getattr(args, "web_ui", True),
        reasoning_parser=reasoning_parser or None,
        default_chat_template_kwargs=template_kwargs,
        prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
        force_include_usage=getattr(args, "enable_force_include_usage", False),
        **batch_settings(args),
    )


def _json_object(value: str | dict | None, name: str) -> dict:
    """A JSON object flag (``{}`` when not given)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    try:
        obj = json.loads(value)
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')}: not valid JSON: {value}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--{name.replace('_', '-')}: must be a JSON object, got {value}")
    return obj


def _list(value: str | list | None, name: str) -> list[str]:
    """A JSON list (vLLM's form) or comma-separated values; default ``["*"]``."""
    if value is None:
        return ["*"]
    if isinstance(value, list):
        items = value
    elif value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')}: not a JSON list: {value}") from None
    else:
        items = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"--{name.replace('_', '-')}: must be a list of strings")
    return items
