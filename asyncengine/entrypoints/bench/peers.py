"""``asyncengine bench peers``: asyncengine next to llama.cpp's ``llama-server`` and vLLM's CPU
build on the same load, in one run, with the ratios.

Each server runs in a subprocess, one after another (never two at once: they would share the
cores). The load is ``asyncengine bench serve``'s client: ``--prompt-len``-token synthetic
prompts, ``--max-tokens`` out, streamed, ``ignore_eos``, at each ``--concurrency`` (a new seed
per run, so no prefix cache answers). A peer that is not installed is reported as such:

- llama-server: ``--llama-server PATH``, else ``llama-server`` on ``PATH``; it serves ``--gguf``
  (default: the embedded SmolLM2 GGUF, the model asyncengine serves by default);
- vLLM: when ``vllm`` is importable by ``--vllm-python`` (default: this Python) and ``--hf-model``
  names an HF directory (a transformers copy of the GGUF: see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

PEERS = ("asyncengine", "llama-server", "vllm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="what asyncengine serves (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--gguf", default=None,
                        help="what llama-server serves (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--hf-model", default=None,
                        help="HF directory vLLM serves (without it vLLM is skipped)")
    parser.add_argument("--llama-server", default=None,
                        help="the llama-server binary (default: llama-server on PATH)")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="a Python that imports vllm (default: this one)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts-per-stream", type=int, default=4,
                        help="requests per run: this times the concurrency, at least 8")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads of every server (default: all cores)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--asyncengine-args", default="",
                        help="more flags for asyncengine serve, e.g. '--compile'")
    parser.add_argument("--llama-server-args", default="",
                        help="extra llama-server flags, one string")
    parser.add_argument("--vllm-args", default="",
                        help='extra vLLM flags, one string (e.g. "--dtype float32" on a CPU '
                             'without bfloat16 arithmetic)')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(peer: str, args: argparse.Namespace, port: int) -> list[str] | str:
    """The command line that serves ``peer`` on ``port``, or why it cannot run."""
    ctx = max(args.concurrency) * (args.prompt_len * 2 + args.max_tokens + 64)
    if peer == "asyncengine":
        cmd = [sys.executable, "-m", "asyncengine", "serve", "--port", str(port),
               "--disable-access-log", "--num-threads", str(args.threads),
               "--max-num-seqs", str(max(max(args.concurrency), 1))]
        cmd += shlex.split(getattr(args, "asyncengine_args", "") or "")
        return cmd + ([args.model] if args.model else [])
    if peer == "llama-server":
        binary = args.llama_server or shutil.which("llama-server")
        if not binary or not os.access(binary, os.X_OK):
            return "not installed (no llama-server on PATH; --llama-server PATH)"
        gguf = args.gguf
        if gguf is None:
            from asyncengine.executor.weights.loader import embedded_model_path

            gguf = embedded_model_path()
        return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(args.threads), "-np", str(max(args.concurrency)), "-c", str(ctx),
                *shlex.split(getattr(args, "llama_server_args", "") or "")]
    probe = subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True)
    if probe.returncode != 0:
        return f"not installed (vllm is not importable by {args.vllm_python})"
    if not args.hf_model:
        return "not run (vllm is installed: give --hf-model DIR, an HF copy of the model)"
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--host",
            "127.0.0.1", "--port", str(port), "--model", args.hf_model,
            "--max-model-len", str(args.prompt_len * 2 + args.max_tokens + 64),
            "--max-num-seqs", str(max(args.concurrency)),
            *shlex.split(getattr(args, "vllm_args", "") or "")]


async def _wait_ready(proc: subprocess.Popen, url: str, log: Any, timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited:\n{log.read().decode()[-3000:]}")
            try:
                async with session.get(url + "/v1/models") as r:
                    if r.status == 200:
                        return
            except (OSError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server did not answer in {timeout:.0f} s")


async def run_peer(peer: str, args: argparse.Namespace, seed: int) -> dict[int, Any] | str:
    """{concurrency: bench serve summary}, or why the peer did not run."""
    from asyncengine.entrypoints.bench.serve import BenchConfig, run_benchmark

    port = _free_port()
    cmd = server_command(peer, args, port)
    if isinstance(cmd, str):
        return cmd
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    if peer == "vllm":  # vLLM's CPU build binds its own OpenMP threads: the same cores
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        await _wait_ready(proc, url, log, args.start_timeout)
        results = {}
        for i, c in enumerate(args.concurrency):
            cfg = BenchConfig(base_url=url, num_prompts=max(8, args.prompts_per_stream * c),
                              concurrency=c, max_tokens=args.max_tokens,
                              prompt_len=args.prompt_len, ignore_eos=True, seed=seed + i)
            results[c] = await run_benchmark(cfg)
        return results
    except RuntimeError as e:
        return f"failed: {e}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def format_table(results: dict[str, dict[int, Any] | str], concurrency: list[int]) -> str:
    lines = [f"{'server':14s} {'concurrency':>11s} {'output tok/s':>13s} {'ITL p50 ms':>11s} "
             f"{'ours / theirs':>14s}"]
    ours = results.get("asyncengine")
    for peer, res in results.items():
        if isinstance(res, str):
            lines.append(f"{peer:14s} {res}")
            continue
        for c in concurrency:
            s = res[c]
            ratio = ""
            if peer != "asyncengine" and isinstance(ours, dict) and s["output_throughput"] > 0:
                ratio = f"{ours[c]['output_throughput'] / s['output_throughput']:.2f}x"
            failed = f"  ({s['failed']} failed)" if s["failed"] else ""
            lines.append(f"{peer:14s} {c:11d} {s['output_throughput']:13.1f} "
                         f"{s['median_itl_ms']:11.1f} {ratio:>14s}{failed}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if any(c < 1 for c in args.concurrency):
        print("asyncengine bench peers: error: --concurrency: must be at least 1",
              file=sys.stderr)
        return 2
    seed = int(time.time()) % 100_000  # a new seed per run: no prefix cache answers
    results: dict[str, dict[int, Any] | str] = {}
    for peer in args.peers:
        print(f"[{peer}] ...", file=sys.stderr, flush=True)
        results[peer] = asyncio.run(run_peer(peer, args, seed))
    print(f"{args.prompt_len}-token prompts, {args.max_tokens} tokens out, streamed, "
          f"ignore_eos, {args.threads} threads per server")
    print(format_table(results, args.concurrency))
    return 0
