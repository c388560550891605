"""Moving a deployment from ``vllm serve``: its command line starts the server (with TLS, the
model's generation config and ``VLLM_API_KEY``), a YAML config takes every flag, and the
plumbing around the API works: CORS preflights, ``--root-path``, ``X-Request-Id``, ``/ping``.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import shutil
import ssl
import time
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.cli import build_parser, main
from asyncengine.entrypoints.flags.engine import apply_yaml_defaults
from asyncengine.text.generation_config import load_generation_defaults
from tests.server_utils import (
    ALLOWED_ORIGIN,
    KEY,
    STARTUP_TIMEOUT_S,
    TOOLS_SERVER_NAMES,
    ServerProcess,
    tools_server,
)


def self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made with ``cryptography``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


class TLSServer(ServerProcess):
    """A server reached over https, its certificate trusted by ``self.ssl``."""

    def __init__(self, model: str, *args: str, cert: str, **kwargs) -> None:
        self.ssl = ssl.create_default_context(cafile=cert)
        super().__init__(model, *args, **kwargs)

    def _wait_ready(self) -> None:
        self.base_url = f"https://127.0.0.1:{self.port}"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2,
                                            context=self.ssl) as r:
                    if r.status == 200:
                        return
            except (OSError, ssl.SSLError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not start:\n{self.log()}")


@pytest.fixture(scope="module")
def vllm_style(tiny_llama, tmp_path_factory):
    """vLLM's usual flags, TLS, the key in VLLM_API_KEY, and a model whose
    generation_config.json asks for greedy decoding and 5 new tokens."""
    root = tmp_path_factory.mktemp("vllm-style")
    model = root / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**config, "temperature": 0.0, "top_k": 50, "max_new_tokens": 5}))
    cert, key_file = self_signed(root)
    server = TLSServer(
        str(model), "--host", "127.0.0.1", "--served-model-name", "m1", "m2",
        "--gpu-memory-utilization", "0.9", "--max-model-len", "512",
        "--tensor-parallel-size", "1", "--trust-remote-code", "--disable-log-requests",
        "--enforce-eager", "--max-logprobs", "20", "--generation-config", "auto",
        "--ssl-keyfile", key_file, "--ssl-certfile", cert, "--num-gpu-blocks-override", "64",
        # vLLM's tuning knobs, accepted and named as ignored (vllm_flags.py)
        "--swap-space", "4", "--disable-custom-all-reduce", "-O3", "--cuda-graph-sizes", "1",
        "2", "4", "--async-scheduling", "--tokenizer-mode", "auto",
        "--enable-prompt-tokens-details", "--enable-force-include-usage",
        cert=cert, env={"VLLM_API_KEY": "vllm-key"})
    yield server
    assert server.stop() == 0


def test_a_vllm_command_line_serves_over_tls(vllm_style):
    http_client = httpx.Client(verify=vllm_style.ssl)
    client = openai.OpenAI(base_url=vllm_style.url("/v1"), api_key="vllm-key", max_retries=0,
                           http_client=http_client)
    assert [m.id for m in client.models.list().data] == ["m1", "m2"]
    assert client.models.retrieve("m2").max_model_len == 512
    # No temperature and no max_tokens: the generation config's greedy decoding and 5 tokens.
    outs = [client.chat.completions.create(model=name, messages=[{"role": "user",
                                                                   "content": "Hello"}])
            for name in ("m1", "m2")]
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    assert outs[0].usage.completion_tokens == 5 and outs[0].model == "m1"
    # --enable-prompt-tokens-details: the second asks with the same prompt, found cached
    assert outs[1].usage.prompt_tokens_details.cached_tokens > 0
    greedy = client.chat.completions.create(model="m1", max_tokens=5, temperature=0,
                                            messages=[{"role": "user", "content": "Hello"}])
    assert greedy.choices[0].message.content == outs[0].choices[0].message.content
    # Streamed over TLS: the pushed events stay on the TLS transport (the batch sender writes
    # plain sockets only), and add up to the same text.
    streamed = client.chat.completions.create(model="m1", max_tokens=5, temperature=0,
                                              stream=True,
                                              messages=[{"role": "user", "content": "Hello"}])
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy.choices[0].message.content
    # --enable-force-include-usage: usage ends the stream without stream_options asking
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=vllm_style.url("/v1"), api_key="wrong", max_retries=0,
                      http_client=http_client).models.list()
    with pytest.raises(urllib.error.URLError):  # a client that does not trust it
        urllib.request.urlopen(vllm_style.url("/health"), timeout=5)
    assert "vLLM flag --swap-space 4: ignored (preempted requests are recomputed" in \
        vllm_style.log()
    log = vllm_style.log()
    assert "--trust-remote-code" in log and "https://127.0.0.1" in log


# -- the plumbing, on the shared tool-calling server ---------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tools_server(tiny_llama)


def raw(server: ServerProcess, method: str, path: str, body: object = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_cors_preflight_and_headers(server):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = raw(server, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200  # no API key on a preflight: browsers send none
    assert headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "AUTHORIZATION" in headers["access-control-allow-headers"].upper()
    status, headers, _ = raw(server, "OPTIONS", "/v1/chat/completions",
                             headers={**preflight, "Origin": "http://evil.example"})
    assert status == 403 and "access-control-allow-origin" not in headers
    status, headers, _ = raw(server, "GET", "/v1/models",
                             headers={**AUTH, "Origin": ALLOWED_ORIGIN, "X-Request-Id": "r1"})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "X-Request-Id" in headers["access-control-expose-headers"]


def test_request_id_ping_and_root_path(server):
    body = {"model": TOOLS_SERVER_NAMES[1], "prompt": "Hi", "max_tokens": 2}
    status, headers, payload = raw(server, "POST", "/v1/completions", body,
                                   {**AUTH, "X-Request-Id": "trace-42"})
    assert status == 200 and headers["x-request-id"] == "trace-42"
    assert json.loads(payload)["id"] == "cmpl-trace-42"
    status, headers, payload = raw(server, "POST", "/v1/chat/completions",
                                   {"messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 2, "stream": True},
                                   {**AUTH, "X-Request-Id": "trace-43"})
    assert headers["x-request-id"] == "trace-43" and b"chatcmpl-trace-43" in payload
    for method in ("GET", "POST"):
        assert raw(server, method, "/ping")[0] == 200  # no key needed
    status, _, payload = raw(server, "GET", "/llm/v1/models", headers=AUTH)
    assert status == 200
    assert [m["id"] for m in json.loads(payload)["data"]] == list(TOOLS_SERVER_NAMES)
    assert raw(server, "GET", "/llm/health")[0] == 200
    assert raw(server, "GET", "/llm/v1/models")[0] == 401


# -- the command line --------------------------------------------------------------------------
def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_version_help_and_flag_errors(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("asyncengine ")
    _, help_, _ = run_cli(capsys, "serve", "--help")
    for group in ("ModelConfig:", "CacheConfig:", "SchedulerConfig:", "ParallelConfig:",
                  "Frontend:"):
        assert group in help_
    for args, flag in ((["-tp", "0"], "--tensor-parallel-size"),
                       (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype"),
                       (["--kv-cache-dtype", "fp8", "--device", "cuda"], "--kv-cache-dtype"),
                       (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
                       (["--generation-config", "/no/such/dir"], "--generation-config"),
                       (["--enable-auto-tool-choice"], "--tool-call-parser")):
        code, _, err = run_cli(capsys, "serve", *args)
        assert code == 2 and flag in err and "Traceback" not in err, args


def test_yaml_config_takes_every_flag(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("host: 0.0.0.0\nport: 9123\nserved-model-name: [a, b]\n"
                   "scheduling-policy: priority\nenable-auto-tool-choice: true\n"
                   "tool-call-parser: hermes\ntensor-parallel-size: 1\n")
    parser = build_parser()
    command = parser._subparsers._group_actions[0].choices["serve"]
    argv = ["serve", "--config", str(cfg), "--port", "9000"]
    args = apply_yaml_defaults(parser, command, argv, parser.parse_args(argv))
    assert (args.host, args.port) == ("0.0.0.0", 9000)  # the command line wins
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    config = EngineConfig.from_cli(args)
    assert config.model.served_model_name == ["a", "b"]
    assert config.scheduler.scheduler == "priority"
    cfg.write_text("hots: 0.0.0.0\n")
    with pytest.raises(ValueError, match="hots"):
        apply_yaml_defaults(parser, command, argv, parser.parse_args(argv))


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100,
        "repetition_penalty": 1.0, "do_sample": True}))  # 1.0: transformers' default
    assert load_generation_defaults("auto", str(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert load_generation_defaults("vllm", str(tmp_path)) == {}
    assert load_generation_defaults(str(tmp_path), "/elsewhere",
                                    overrides={"temperature": 0.1})["temperature"] == 0.1
    with pytest.raises(ValueError, match="--override-generation-config"):
        load_generation_defaults("vllm", None, overrides={"beams": 2})
