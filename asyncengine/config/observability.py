"""``--otlp-traces-endpoint`` and ``--collect-detailed-traces``: OpenTelemetry tracing, as
vLLM's ObservabilityConfig takes it (``engine/tracing.py`` makes the spans).

The SDK is the optional extra ``asyncengine[otel]``; a configuration that asks for traces
without it is refused here, before a model is loaded. The OTLP protocol is vLLM's
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` (the default) or ``http/protobuf``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from asyncengine.config import environment

#: --collect-detailed-traces values (vLLM's ``DetailedTraceModules``).
DETAILED_TRACE_MODULES = ("model", "worker", "all")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
#: The OTLP protocols, and the exporter module each needs.
EXPORTERS = {"grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
             "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter"}
INSTALL_HINT = "pip install 'asyncengine[otel]'"


@dataclass
class ObservabilityConfig:
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "export one OpenTelemetry span per request to this OTLP endpoint, e.g. "
                "http://localhost:4317 (gRPC) or http://localhost:4318/v1/traces "
                f"(${PROTOCOL_ENV}=http/protobuf); needs {INSTALL_HINT}; default: off"})
    collect_detailed_traces: list[str] | str | None = field(default=None, metadata={
        "help": "with --otlp-traces-endpoint, add each request's time in prefill, in decode "
                "and running to its span: model, worker or all (vLLM's values; "
                "comma-separated or several); default: off", "nargs": "+"})


def validate_observability(oc: ObservabilityConfig) -> None:
    """Normalize ``collect_detailed_traces`` to a list; refuse what cannot trace."""
    detailed = oc.collect_detailed_traces
    if isinstance(detailed, str):
        detailed = [detailed]
    if detailed is not None:
        detailed = [v.strip() for item in detailed for v in str(item).split(",") if v.strip()]
        for value in detailed:
            if value not in DETAILED_TRACE_MODULES:
                raise ValueError(f"--collect-detailed-traces: invalid value {value!r} "
                                 f"(allowed: {', '.join(DETAILED_TRACE_MODULES)})")
        if detailed and not oc.otlp_traces_endpoint:
            raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")
    oc.collect_detailed_traces = detailed or None
    if not oc.otlp_traces_endpoint:
        oc.otlp_traces_endpoint = None
        return
    protocol = otlp_protocol()
    if not (_importable("opentelemetry.sdk.trace") and _importable(EXPORTERS[protocol])):
        raise ValueError(f"--otlp-traces-endpoint: the OpenTelemetry SDK and its OTLP {protocol} "
                         f"exporter are not installed ({INSTALL_HINT})")


def otlp_protocol() -> str:
    """``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``: ``grpc`` or ``http/protobuf``."""
    protocol = environment.get(PROTOCOL_ENV)
    if protocol not in EXPORTERS:
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: not an OTLP protocol asyncengine "
                         f"exports with (allowed: {', '.join(EXPORTERS)})")
    return protocol


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing (or blocked)
        return False
