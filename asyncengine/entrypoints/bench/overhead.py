"""``asyncengine bench overhead``: what the event loop itself costs per stream and step.

Many concurrent streams over real HTTP, against two runners, next to a bare aiohttp server
that sends the same OpenAI-shaped SSE chunks (the ceiling for this HTTP stack and client),
all measured in the same run:

* ``null``: a runner with no forward pass; it returns token ids at once. What is left is the
  loop: HTTP, tokenization, scheduling, preparing inputs, emission, SSE writes.
* ``near-null``: the same, with a 600-token vocabulary (the tokenizer's first 600 pieces):
  a real forward pass and sampling whose head costs next to nothing, so that what is
  measured is the loop (the issue's "near-null model").
* ``tiny``: random weights of 2 layers and hidden size 64 with SmolLM2's tokenizer and its
  49,152-token vocabulary (``--load-format dummy``): a real but cheap forward pass.

For each, it prints output tokens/s and the ratio to the bare server; the loop thread's CPU
time per stream per step (``time.thread_time`` of the loop's thread, over the steps' total
request count), with the part spent in the step path proper (schedule, prepare, launch,
update, emission including the pushed SSE writes; the rest is HTTP: requests, handlers,
connections) and, for scale, the bare server's own loop CPU per chunk and this client's CPU
per chunk against it (on a small machine the client is what holds the bare server back:
it shares the cores); the fraction of the run the device sat waiting for the host; and the
whole server process's CPU per streamed token (every thread, read from ``/proc/PID/stat`` by
this client), next to the bare server's: the figure issue 48 bounds at 2/3 of the bare one.

The servers run in subprocesses (this process is the client), one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncengine.config import environment

RUNNERS = ("null", "near-null", "tiny")
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
PROMPT = "Tell me a story about a lighthouse keeper."
#: ``near-null``: the tiny model with a 600-token vocabulary (the issue's near-null model), so
#: that the head and sampling cost next to nothing; its prompt is token ids inside it.
NEAR_NULL_CONFIG = {**TINY_CONFIG, "vocab_size": 600}
NEAR_NULL_PROMPT = list(range(300, 340))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024],
                        help="concurrent streams, one run each (default: 64 256 1024)")
    parser.add_argument("--tokens", type=int, default=256,
                        help="output tokens per stream (default: 256)")
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS,
                        help="which runners to measure (default: null tiny)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    # Internal: run one server (the benchmark starts these itself).
    parser.add_argument("--serve", choices=(*RUNNERS, "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--max-num-seqs", type=int, default=256, help=argparse.SUPPRESS)


# -- the model directory -------------------------------------------------------------------------
def make_model_dir(root: Path, config: dict[str, Any] = TINY_CONFIG) -> str:
    """A model's config (the tiny model's by default) plus SmolLM2's tokenizer, from the
    embedded GGUF."""
    from asyncengine.executor.weights.loader import embedded_model_path
    from asyncengine.text.tokenizer import load_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    load_tokenizer(embedded_model_path()).hf.save_pretrained(str(root))
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


# -- the servers (subprocesses) ------------------------------------------------------------------
def _null_execute(runner: Any, token_id: int):
    from asyncengine.core.sched.interface import ModelRunnerOutput

    def execute(inputs: Any) -> ModelRunnerOutput:
        return ModelRunnerOutput({rid: token_id for rid in inputs.sample_req_ids})

    return execute


async def _serve_engine(args: argparse.Namespace) -> None:
    import anyio
    from aiohttp import web

    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.engine.gc_policy import tune_for_serving
    from asyncengine.engine.metrics import EngineMetrics
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import ServerSettings

    n = args.max_num_seqs
    config = EngineConfig.from_dict({
        "model": args.model_dir, "load_format": "dummy", "dtype": "float32",
        "max_num_seqs": n, "max_num_batched_tokens": max(2048, 16 * n),
        "max_model_len": 1024, "kv_cache_memory": "256MiB",
        "num_threads": int(environment.get("ASYNCENGINE_BENCH_THREADS")) or None})
    engine = AsyncEngine(config)
    if args.serve == "null":
        token = engine.tokenizer.encode(" the", add_special_tokens=False)[0]
        engine.runner.execute = _null_execute(engine.runner, token)
    engine.metrics = EngineMetrics(engine.model_name)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({
            "loop_cpu_s": time.thread_time(), "process_cpu_s": time.process_time(),
            "wall_s": time.perf_counter(), "steps": engine.loop.num_steps,
            "stream_steps": engine.loop.num_stream_steps,
            "step_cpu_s": engine.loop.step_cpu_s, "device_busy_s": engine.device.busy_s})

    async with engine:
        app = build_app(engine, engine.metrics, ServerSettings(access_log=False))
        app.router.add_get("/bench/stats", stats)
        await _run_app(app, args.port)
        tune_for_serving()  # as `asyncengine serve` does once it serves
        await anyio.sleep_forever()


async def _serve_bare(args: argparse.Namespace) -> None:
    """The same chunks from a handler that does nothing else."""
    import msgspec
    from aiohttp import web

    encode = msgspec.json.Encoder().encode

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        for i in range(body["max_tokens"]):
            last = i == body["max_tokens"] - 1
            chunk = {"id": "cmpl-bare", "object": "text_completion", "created": created,
                     "model": "bare", "choices": [{"index": 0, "text": " the", "logprobs": None,
                                                   "finish_reason": "length" if last else None}]}
            await resp.write(b"data: " + encode(chunk) + b"\n\n")
            await asyncio.sleep(0)  # one token at a time, as a decode step would
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"loop_cpu_s": time.thread_time(),
                                  "process_cpu_s": time.process_time(),
                                  "wall_s": time.perf_counter(), "steps": 0,
                                  "stream_steps": 0, "step_cpu_s": 0.0,
                                  "device_busy_s": 0.0})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/bench/stats", stats)
    await _run_app(app, args.port)
    await asyncio.Event().wait()


async def _run_app(app: Any, port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) of process ``pid`` so far, from
    ``/proc/PID/stat``; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Server:
    def __init__(self, kind: str, model_dir: str, max_num_seqs: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncengine.entrypoints.bench.overhead", "--serve", kind,
             "--port", str(self.port), "--model-dir", model_dir,
             "--max-num-seqs", str(max_num_seqs)],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    async def wait_ready(self, session: Any, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited:\n{self.log.read().decode()[-3000:]}")
            try:
                async with session.get(self.url + "/bench/stats") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


# -- the client ----------------------------------------------------------------------------------
async def _stream_one(session: Any, url: str, tokens: int,
                      prompt: str | list[int] = PROMPT) -> int:
    body = {"model": None, "prompt": prompt, "max_tokens": tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        tail = b""
        async for chunk in r.content.iter_any():
            tail = (tail + chunk)[-64:]
        if b"[DONE]" not in tail:
            raise RuntimeError("a stream ended without [DONE]")
    return tokens


async def measure(kind: str, model_dir: str, streams: int, tokens: int) -> dict[str, Any]:
    prompt = NEAR_NULL_PROMPT if kind == "near-null" else PROMPT
    import aiohttp

    server = _Server(kind, model_dir, streams)
    try:
        conn = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            await server.wait_ready(session)
            await _stream_one(session, server.url, 4, prompt)  # warm-up
            async with session.get(server.url + "/bench/stats") as r:
                before = await r.json()
            start, client_cpu = time.perf_counter(), time.process_time()
            server_cpu = proc_cpu_s(server.proc.pid)
            done = await asyncio.gather(*[_stream_one(session, server.url, tokens, prompt)
                                          for _ in range(streams)])
            wall = time.perf_counter() - start
            client_cpu = time.process_time() - client_cpu
            if server_cpu is not None:
                server_cpu = proc_cpu_s(server.proc.pid) - server_cpu
            async with session.get(server.url + "/bench/stats") as r:
                after = await r.json()
    finally:
        server.stop()
    result: dict[str, Any] = {"server": kind, "streams": streams, "tokens": tokens,
                              "tokens_per_s": sum(done) / wall, "wall_s": wall,
                              "client_us_per_chunk": client_cpu / sum(done) * 1e6}
    if server_cpu is not None:  # the whole server process (every thread), from /proc
        result["process_us_per_token"] = server_cpu / sum(done) * 1e6
    stream_steps = after["stream_steps"] - before["stream_steps"]
    cpu = after["loop_cpu_s"] - before["loop_cpu_s"]
    if kind == "bare":  # its loop's CPU per chunk sent: the HTTP floor of this machine
        result["loop_us_per_chunk"] = cpu / sum(done) * 1e6
    if stream_steps:
        server_wall = after["wall_s"] - before["wall_s"]
        result["loop_us_per_stream_step"] = cpu / stream_steps * 1e6
        result["process_us_per_stream_step"] = \
            (after["process_cpu_s"] - before["process_cpu_s"]) / stream_steps * 1e6
        result["step_path_us_per_stream_step"] = \
            (after["step_cpu_s"] - before["step_cpu_s"]) / stream_steps * 1e6
        result["steps"] = after["steps"] - before["steps"]
        result["device_wait_frac"] = 1 - (after["device_busy_s"]
                                          - before["device_busy_s"]) / server_wall
    return result


def main(args: argparse.Namespace) -> int:
    if args.serve:
        import anyio

        if args.serve == "bare":
            anyio.run(_serve_bare, args)
        else:
            anyio.run(_serve_engine, args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "tiny")
        dirs = {"near-null": make_model_dir(Path(tmp) / "near-null", NEAR_NULL_CONFIG)}
        rows = []
        for n in args.streams:
            bare = asyncio.run(measure("bare", model_dir, n, args.tokens))
            rows.append(bare)
            for kind in args.runners:
                r = asyncio.run(measure(kind, dirs.get(kind, model_dir), n, args.tokens))
                r["ratio_to_bare"] = r["tokens_per_s"] / bare["tokens_per_s"]
                if "process_us_per_token" in r and bare.get("process_us_per_token"):
                    r["process_cpu_to_bare"] = (r["process_us_per_token"]
                                                / bare["process_us_per_token"])
                rows.append(r)
                print(_format(r, bare), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _format(r: dict[str, Any], bare: dict[str, Any]) -> str:
    return (f"{r['server']:>4} runner, {r['streams']:>5} streams x {r['tokens']} tokens: "
            f"{r['tokens_per_s']:>8.0f} tok/s = {r['ratio_to_bare']:.2f}x bare "
            f"({bare['tokens_per_s']:.0f} tok/s); loop {r['loop_us_per_stream_step']:.1f} "
            f"us/stream/step (step path {r['step_path_us_per_stream_step']:.1f}; whole process "
            f"{r['process_us_per_stream_step']:.1f}; bare server "
            f"{bare['loop_us_per_chunk']:.1f} us/chunk, its client "
            f"{bare['client_us_per_chunk']:.1f}) over {r['steps']} steps; device waiting "
            f"{100 * r['device_wait_frac']:.0f}% of the run"
            + (f"; server process CPU per token {r['process_us_per_token']:.1f} us = "
               f"{r['process_cpu_to_bare']:.2f}x the bare server's "
               f"({bare['process_us_per_token']:.1f} us)" if "process_cpu_to_bare" in r
               else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="asyncengine bench overhead",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
