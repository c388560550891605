"""``--otlp-traces-endpoint``: one span per request reaches an OTLP receiver, over gRPC (the
real server, a chat completion with a ``traceparent``) and over http/protobuf (an engine in
this process), with vLLM's attributes, as a child of the caller's span."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncengine.config import EngineConfig, ObservabilityConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.output_processor import OutputProcessor
from asyncengine.engine.tracing import TracedOutputProcessor, make_output_processor, trace_headers
from tests.server_utils import ServerProcess

grpc = pytest.importorskip("grpc")
trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2")
trace_service_pb2_grpc = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
ROOT = Path(__file__).resolve().parents[2]


class Spans:
    """The spans an OTLP receiver got, decoded: [{name, trace_id, parent_span_id, kind,
    attributes, start, end}] (ids in hex, times in ns)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.got = threading.Condition()

    def add(self, request: Any) -> None:
        with self.got:
            for rs in request.resource_spans:
                resource = _attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "name": s.name, "trace_id": s.trace_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(), "kind": s.kind,
                            "attributes": _attributes(s.attributes), "resource": resource,
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano})
            self.got.notify_all()

    def wait(self, n: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
        with self.got:
            self.got.wait_for(lambda: len(self.spans) >= n, timeout)
            return list(self.spans)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@pytest.fixture
def grpc_receiver():
    """A gRPC OTLP collector stand-in: (endpoint, spans)."""
    spans = Spans()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 (the generated name)
            spans.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", spans
    server.stop(grace=None)


@pytest.fixture
def http_receiver():
    """An http/protobuf OTLP receiver at /v1/traces: (endpoint, spans)."""
    spans = Spans()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces"
            assert self.headers["Content-Type"] == "application/x-protobuf"
            spans.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", spans
    server.shutdown()
    server.server_close()


def test_a_chat_completion_is_one_span_over_grpc(tiny_llama, grpc_receiver):
    endpoint, spans = grpc_receiver
    server = ServerProcess(tiny_llama, "--num-gpu-blocks-override", "256",
                           "--served-model-name", "tiny", "--otlp-traces-endpoint", endpoint,
                           env={"OTEL_BSP_SCHEDULE_DELAY": "600000"})  # exported at exit
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "n": 2}
        req = urllib.request.Request(
            server.url("/v1/chat/completions"), json.dumps(body).encode(),
            {"Content-Type": "application/json", "traceparent": TRACEPARENT,
             "X-Request-Id": "traced"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
        # A request without a trace context is a root span of its own trace.
        req = urllib.request.Request(
            server.url("/v1/completions"),
            json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).close()
    finally:
        log = server.log()
        assert server.stop() == 0
    got = spans.wait(2)
    assert len(got) == 2, log
    span = next(s for s in got if s["attributes"]["gen_ai.request.id"] == "chatcmpl-traced")
    assert span["name"] == "llm_request" and span["kind"] == 2  # SPAN_KIND_SERVER
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_ID
    assert span["resource"]["service.name"] == "asyncengine"
    a = span["attributes"]
    usage = reply["usage"]
    assert a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 2
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [c["finish_reason"]
                                                   for c in reply["choices"]]
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"]
    assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert span["end"] - span["start"] == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=1e6)
    assert abs(span["end"] / 1e9 - time.time()) < 120  # Unix time, not the monotonic clock
    assert not any(k.startswith("gen_ai.latency.time_in_model") for k in a)  # not detailed
    other = next(s for s in got if s is not span)
    assert other["trace_id"] != TRACE_ID and other["parent_span_id"] == ""


def test_an_engine_exports_over_http_protobuf_with_detailed_traces(
        tiny_llama, http_receiver, monkeypatch):
    endpoint, spans = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    from asyncengine.engine.engine import AsyncEngine

    engine = AsyncEngine(EngineConfig.from_dict({
        "model": tiny_llama, "num_gpu_blocks_override": 64, "otlp_traces_endpoint": endpoint,
        "collect_detailed_traces": "model,worker"}))
    assert isinstance(engine.outputs, TracedOutputProcessor)

    async def run() -> int:
        async with engine:
            tokens = 0
            async for out in engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=4,
                                                                           temperature=0),
                                             request_id="r1",
                                             trace_headers={"traceparent": TRACEPARENT}):
                tokens = len(out.outputs[0].token_ids)
            return tokens

    tokens = anyio.run(run)
    assert engine.outputs.tracer.flush()
    engine.outputs.tracer.provider.shutdown()
    [span] = spans.wait(1)
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_ID
    a = span["attributes"]
    assert a["gen_ai.request.id"] == "r1" and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.prompt_tokens"] == 4 and a["gen_ai.usage.completion_tokens"] == tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    prefill = a["gen_ai.latency.time_in_model_prefill"]
    decode = a["gen_ai.latency.time_in_model_decode"]
    assert prefill >= 0 and decode >= 0
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)


def test_without_the_flag_nothing_traces():
    assert type(make_output_processor(None, ObservabilityConfig(), "m")) is OutputProcessor
    assert trace_headers({"Content-Type": "x"}) is None
    assert trace_headers({"traceparent": TRACEPARENT, "tracestate": "a=1", "x": "y"}) == {
        "traceparent": TRACEPARENT, "tracestate": "a=1"}


def test_without_the_sdk_the_server_exits_2_naming_the_flag_and_the_extra():
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from asyncengine.entrypoints.cli import main\n"
            "sys.exit(main(['serve', '--otlp-traces-endpoint', 'http://127.0.0.1:4317']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "--otlp-traces-endpoint" in r.stderr
    assert "pip install 'asyncengine[otel]'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("values, error", [
    ({"collect_detailed_traces": "all"}, "--collect-detailed-traces needs --otlp-traces"),
    ({"otlp_traces_endpoint": "http://h:4317", "collect_detailed_traces": ["model", "gpu"]},
     "--collect-detailed-traces: invalid value 'gpu'"),
])
def test_flags_are_checked(values, error):
    with pytest.raises(ValueError, match=error):
        EngineConfig.from_dict(values)


def test_an_unknown_protocol_names_the_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        EngineConfig.from_dict({"otlp_traces_endpoint": "http://h:4317"})
