"""The consumer modes of ``asyncengine bench host``: who reads the streams, and how.

A mode runs one measured batch of streams against an engine (after a warm-up batch of its
own, with other prompts) and returns the probe's snapshots around it and the tokens each
stream received:

* ``generate``: in-process, one task per stream iterating ``engine.generate()`` (cumulative
  outputs, the default), as ``benchmarks/gpu.py`` measured the H100.
* ``http``: the real aiohttp app (``build_app``, with its metrics, as ``asyncengine serve``
  runs it) on a loopback port, and a client in a subprocess (so that its CPU is not the
  loop thread's; it shares the machine) streaming ``/v1/completions`` with token-id prompts;
  each stream counts its tokens from the final usage chunk.
* ``batch``: in-process, one task reading every stream through ``engine.generate_many()``
  (delta outputs): one wake-up per step for all of them (``engine/stream_group.py``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the client subprocess imports this module: nothing heavy at import
    from asyncengine.entrypoints.bench.host_probe import Probe

#: Modes named but not built, and why.
NOT_BUILT: dict[str, str] = {}
WARMUP_TOKENS = 4


def prompt_ids(i: int, length: int, first: int, vocab: int, salt: int = 0) -> list[int]:
    """Stream ``i``'s prompt: ``length`` ids in ``[first, vocab)``, unlike every other
    stream's and every other ``salt``'s from the first block on."""
    span = vocab - first
    return [first + (salt * 7919 + i * 104729 + j * (2 * i + 3)) % span
            for j in range(length)]


class Consumers(Protocol):
    name: str
    description: str

    async def run(self, engine: Any, probe: Probe, prompts: list[list[int]],
                  warmup: list[list[int]], tokens: int
                  ) -> tuple[dict[str, Any], dict[str, Any], list[int], dict[str, Any]]:
        """Warm up, then the measured streams: (snapshot before, snapshot after, tokens each
        stream received, figures of the mode's own)."""
        ...


class GenerateConsumers:
    name = "generate"
    description = "in-process engine.generate(), one task per stream"

    async def run(self, engine: Any, probe: Probe, prompts: list[list[int]],
                  warmup: list[list[int]], tokens: int
                  ) -> tuple[dict[str, Any], dict[str, Any], list[int], dict[str, Any]]:
        probe.install()
        async with engine:
            await self._streams(engine, warmup, WARMUP_TOKENS)
            before = probe.snapshot()
            delivered = await self._streams(engine, prompts, tokens)
            after = probe.snapshot()
        return before, after, delivered, {}

    @staticmethod
    async def _streams(engine: Any, prompts: list[list[int]], tokens: int) -> list[int]:
        import anyio

        from asyncengine.core.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        delivered = [0] * len(prompts)

        async def one(i: int) -> None:
            async for out in engine.generate(prompts[i], params):
                delivered[i] = len(out.outputs[0].token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return delivered


class BatchConsumers(GenerateConsumers):
    name = "batch"
    description = "in-process engine.generate_many(), one task for every stream"

    @staticmethod
    async def _streams(engine: Any, prompts: list[list[int]], tokens: int) -> list[int]:
        from asyncengine.core.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        import anyio

        delivered = [0] * len(prompts)
        index: dict[str, int] = {}

        async def read() -> None:  # a task of its own, as the other modes' consumers
            async for outputs in engine.generate_many(prompts, params,
                                                      request_id=f"host-{id(prompts)}"):
                for out in outputs:
                    i = index.get(out.request_id)
                    if i is None:
                        i = index[out.request_id] = int(out.request_id.rsplit("-", 1)[1])
                    delivered[i] += len(out.outputs[0].token_ids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
        return delivered


class HTTPConsumers:
    name = "http"
    description = ("SSE streams of /v1/completions over loopback sockets, the client in a "
                   "subprocess")

    async def run(self, engine: Any, probe: Probe, prompts: list[list[int]],
                  warmup: list[list[int]], tokens: int
                  ) -> tuple[dict[str, Any], dict[str, Any], list[int], dict[str, Any]]:
        import anyio
        from aiohttp import web

        from asyncengine.entrypoints.bench.overhead import _free_port
        from asyncengine.entrypoints.http.app import build_app
        from asyncengine.entrypoints.http.server import make_metrics
        from asyncengine.entrypoints.http.state import ServerSettings

        marks: list[dict[str, Any]] = []

        async def mark(request: web.Request) -> web.Response:
            marks.append(probe.snapshot())
            return web.json_response({})

        port = _free_port()
        spec = {"url": f"http://127.0.0.1:{port}", "prompts": prompts, "warmup": warmup,
                "tokens": tokens}
        probe.install()
        metrics, engine.metrics = engine.metrics, make_metrics(engine)
        try:
            async with engine:
                app = build_app(engine, engine.metrics, ServerSettings(access_log=False))
                app.router.add_get("/bench/mark", mark)
                runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
                await runner.setup()
                try:
                    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
                    done = await anyio.run_process(
                        [sys.executable, "-m", "asyncengine.entrypoints.bench.host_consumers"],
                        input=json.dumps(spec).encode(), check=False)
                finally:
                    await runner.cleanup()
        finally:
            engine.metrics = metrics
        if done.returncode != 0 or len(marks) != 2:
            raise RuntimeError(f"the HTTP client failed ({done.returncode}):\n"
                               f"{done.stderr.decode()[-3000:]}")
        client = json.loads(done.stdout)
        return marks[0], marks[1], client["delivered"], {
            "client_cpu_us_per_token": client["cpu_s"] / max(sum(client["delivered"]), 1) * 1e6}


MODES: dict[str, type] = {"generate": GenerateConsumers, "http": HTTPConsumers,
                          "batch": BatchConsumers}


# -- the HTTP client (a subprocess: ``python -m ...host_consumers`` < spec) -----------------------
async def _stream(session: Any, url: str, prompt: list[int], tokens: int) -> int:
    body = {"model": None, "prompt": prompt, "max_tokens": tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        tail = b""
        async for chunk in r.content.iter_any():
            tail = (tail + chunk)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    if not tail.rstrip().endswith(b"data: [DONE]") or not events:
        raise RuntimeError("a stream ended without its usage and [DONE]")
    return json.loads(events[-1][6:])["usage"]["completion_tokens"]


async def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    import aiohttp

    url, tokens = spec["url"], spec["tokens"]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        # The warm-up opens every connection the measured streams will reuse.
        await asyncio.gather(*[_stream(session, url, p, WARMUP_TOKENS)
                               for p in spec["warmup"]])
        async with session.get(url + "/bench/mark") as r:
            r.raise_for_status()
        cpu = time.process_time()
        delivered = await asyncio.gather(*[_stream(session, url, p, tokens)
                                           for p in spec["prompts"]])
        cpu = time.process_time() - cpu
        async with session.get(url + "/bench/mark") as r:
            r.raise_for_status()
    return {"delivered": list(delivered), "cpu_s": cpu}


if __name__ == "__main__":
    import asyncio

    print(json.dumps(asyncio.run(_client(json.loads(sys.stdin.read())))))
