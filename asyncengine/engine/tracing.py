"""One OpenTelemetry span per request, as vLLM exports them (``--otlp-traces-endpoint``).

A request's span is made when its stream closes (it finished, was aborted or failed): named
``llm_request``, of kind SERVER, from the request's arrival to the emission that ended it,
a child of the caller's span when the request carried a W3C ``traceparent`` (the HTTP layer
passes the ``traceparent`` / ``tracestate`` headers as ``trace_headers``). Its attributes are
vLLM's (``SpanAttributes``). The SDK's ``BatchSpanProcessor`` exports the ended spans from its
own thread, so the loop only builds them; the provider flushes what is left at exit.

Without the flag none of this exists: the engine's ``OutputProcessor`` is the plain one
(:func:`make_output_processor` is the one place that decides), and no request carries trace
headers, so tracing adds no work per request or per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from importlib import import_module
from typing import Any

from asyncengine.config import ObservabilityConfig
from asyncengine.config.observability import EXPORTERS, otlp_protocol
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.engine.streams import RequestStream
from asyncengine.text.tokenizer import Tokenizer

logger = logging.getLogger("asyncengine")

#: The W3C Trace Context headers a request's trace context travels in.
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's attribute names (``vllm/tracing.py``): the OpenTelemetry GenAI conventions'
    where they exist, ``gen_ai.*`` of its own for the rest."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    # --collect-detailed-traces
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace-context headers among ``headers`` (None: there are none)."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


class RequestTracer:
    """Ends one span per finished request stream; owns the tracer provider and its exporter."""

    def __init__(self, config: ObservabilityConfig, model_name: str, *,
                 exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            module = import_module(EXPORTERS[otlp_protocol()])
            exporter = module.OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)
        resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "asyncengine"}))
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("asyncengine")
        self.model_name = model_name
        self.detailed = bool(config.collect_detailed_traces)
        self._extract = TraceContextTextMapPropagator().extract
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)

    def end(self, stream: RequestStream, now: float) -> None:
        """The span of ``stream``, which ended at ``now`` (monotonic seconds)."""
        first = stream.samples[0].request
        to_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> Unix epoch, in ns
        headers = stream.trace_headers
        span = self.tracer.start_span(
            SPAN_NAME, context=self._extract(headers) if headers else None, kind=self._server,
            attributes=self.attributes(stream, now),
            start_time=int(first.arrival_time * 1e9) + to_ns)
        if any(s.finish_reason == "error" for s in stream.samples):
            span.set_status(self._error)
        span.end(end_time=int(now * 1e9) + to_ns)

    def attributes(self, stream: RequestStream, now: float) -> dict[str, Any]:
        a = SpanAttributes
        first = stream.samples[0].request
        sp, arrived = first.sampling_params, first.arrival_time
        out: dict[str, Any] = {
            a.GEN_AI_REQUEST_ID: stream.request_id,
            a.GEN_AI_REQUEST_TEMPERATURE: sp.temperature,
            a.GEN_AI_REQUEST_TOP_P: sp.top_p,
            a.GEN_AI_REQUEST_N: len(stream.samples),
            a.GEN_AI_RESPONSE_MODEL: first.lora.name if first.lora else self.model_name,
            a.GEN_AI_RESPONSE_FINISH_REASONS: [s.finish_reason or "abort"
                                               for s in stream.samples],
            a.GEN_AI_USAGE_PROMPT_TOKENS: len(stream.prompt_token_ids),
            a.GEN_AI_USAGE_COMPLETION_TOKENS: sum(s.num_emitted for s in stream.samples),
            a.GEN_AI_LATENCY_E2E: now - arrived,
        }
        if sp.max_tokens is not None:
            out[a.GEN_AI_REQUEST_MAX_TOKENS] = sp.max_tokens
        scheduled, first_token = first.first_scheduled_time, first.first_token_time
        last_token = first.last_token_time
        if scheduled is not None:
            out[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled - arrived
        if first_token is not None:
            out[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token - arrived
        if self.detailed and scheduled is not None and first_token is not None:
            out[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first_token - scheduled
            if last_token is not None:
                out[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last_token - first_token
                out[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last_token - scheduled
        return out

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export the ended spans now (blocking: off the loop)."""
        return self.provider.force_flush(int(timeout_s * 1000))


class TracedOutputProcessor(OutputProcessor):
    """Emission that also ends each closed stream's span."""

    def __init__(self, tokenizer: Tokenizer, tracer: RequestTracer) -> None:
        super().__init__(tokenizer)
        self.tracer = tracer

    def _close(self, stream: RequestStream, now: float) -> None:
        super()._close(stream, now)
        try:
            self.tracer.end(stream, now)
        except Exception:  # a span is never worth a request's output
            logger.exception("request %s: its trace span failed", stream.request_id)


def make_output_processor(tokenizer: Tokenizer, config: ObservabilityConfig,
                          model_name: str) -> OutputProcessor:
    """The engine's emission: traced with ``--otlp-traces-endpoint``, else the plain one."""
    if config.otlp_traces_endpoint is None:
        return OutputProcessor(tokenizer)
    return TracedOutputProcessor(tokenizer, RequestTracer(config, model_name))
