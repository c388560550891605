"""The ``asyncengine`` command: serve | generate | run-batch | bench {serve, throughput,
overhead, peers, host, models}."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.flags.engine import (
    add_config_arg,
    add_engine_args,
    apply_yaml_defaults,
)


def _plugin_cli_hook(parser: argparse.ArgumentParser, command: str) -> None:
    try:
        from asyncengine.ext.registry import get_plugin_manager
    except ImportError:
        return
    get_plugin_manager().hook.add_cli_arguments(parser=parser, command=command)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_config_arg(parser)
    add_engine_args(parser)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncengine")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncengine",
        description="An LLM inference and serving engine built around one event loop.")
    parser.add_argument("--version", action="version", version=f"asyncengine {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /metrics, ...). With no MODEL, the "
                    "embedded SmolLM2-135M-Instruct is served.")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF directory, hub id or .gguf file (default: embedded SmolLM2)")
    serve.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the model, as a flag (vLLM's form; instead of the positional)")
    from asyncengine.entrypoints.http.server import add_serve_arguments

    add_serve_arguments(serve)
    _add_engine_flags(serve)
    _plugin_cli_hook(serve, "serve")

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout",
                         description="Generate a reply to PROMPT (through the chat template "
                                     "unless --raw) and stream it to stdout.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help="HF directory, hub id or .gguf file "
                                                   "(default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the chat template")
    gen.add_argument("--log-level", default="warning",
                     choices=["debug", "info", "warning", "error"])
    _add_engine_flags(gen)
    _plugin_cli_hook(gen, "generate")

    batch = sub.add_parser(
        "run-batch", help="run a batch file (OpenAI's batch format) offline",
        description="Run the requests of a JSONL batch file (OpenAI's format: custom_id, "
                    "method, url, body) through MODEL in this process, as vLLM's run-batch, "
                    "and write each one's result, in the input's order.")
    batch.add_argument("model", nargs="?", default=None,
                       help="HF directory, hub id or .gguf file (default: embedded SmolLM2)")
    batch.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the model, as a flag (vLLM's form; instead of the positional)")
    from asyncengine.entrypoints.flags.batch import add_run_batch_arguments

    add_run_batch_arguments(batch)
    _add_engine_flags(batch)
    _plugin_cli_hook(batch, "run-batch")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    bserve = bsub.add_parser("serve", help="load-test an OpenAI-compatible server",
                             description="An OpenAI-compatible load generator against any "
                                         "base URL; reports throughput, TTFT, TPOT, ITL.")
    from asyncengine.entrypoints.bench import serve as bench_serve

    bench_serve.add_arguments(bserve)
    bthr = bsub.add_parser("throughput", help="offline throughput against transformers",
                           description="Offline output tokens/s of asyncengine next to "
                                       "transformers' generate on the same prompts.")
    from asyncengine.entrypoints.bench import throughput as bench_throughput

    bench_throughput.add_arguments(bthr)
    bover = bsub.add_parser("overhead", help="the event loop's own cost at many streams",
                            description="Output tokens/s over real HTTP at many streams with a "
                                        "null and a tiny-weights runner, next to a bare "
                                        "aiohttp server; the loop's CPU per stream per step.")
    from asyncengine.entrypoints.bench import overhead as bench_overhead

    bench_overhead.add_arguments(bover)
    bpeers = bsub.add_parser("peers", help="asyncengine next to llama-server and vLLM-CPU",
                             description="The same streamed load against asyncengine and, "
                                         "where installed, llama-server and vLLM's CPU build, "
                                         "one after another; prints the ratios.")
    from asyncengine.entrypoints.bench import peers as bench_peers

    bench_peers.add_arguments(bpeers)
    bhost = bsub.add_parser("host", help="the host's work per step against a simulated GPU",
                            description="The engine on its CUDA step path, with CUDA, "
                                        "FlashInfer and CUDA graphs simulated: the loop "
                                        "thread's CPU per step and per stream by phase, and "
                                        "the simulated GPU's idle time.")
    from asyncengine.entrypoints.bench import host as bench_host

    bench_host.add_arguments(bhost)
    bmodels = bsub.add_parser("models", help="several models in one server: cold loads, sleep, "
                              "switches, a light model next to a busy one",
                              description="Time to first token of a router server's models: a "
                                          "cold load (and a fresh process), after sleep levels "
                                          "1 and 2, a warm switch, a light model while another "
                                          "serves many streams.")
    from asyncengine.entrypoints.bench import models as bench_models

    bench_models.add_arguments(bmodels)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["serve"], ["run-batch"]):  # vLLM's (and llama-server's) flags
        from asyncengine.entrypoints.flags import llama_server as llama_flags
        from asyncengine.entrypoints.flags import vllm as vllm_flags

        command = argv[0]
        own = {s for a in _subparser(parser, command)._actions for s in a.option_strings}

        def say(line: str) -> None:
            print(f"asyncengine {command}: {line}", file=sys.stderr)

        try:
            rest = vllm_flags.translate(argv[1:], own, say)
            if command == "serve":
                rest = llama_flags.translate(rest, own, say)
            argv = [command, *rest]
        except ValueError as e:
            parser.exit(2, f"asyncengine {command}: error: {e}\n")
    args = parser.parse_args(argv)
    if args.command in ("serve", "generate", "run-batch"):
        try:
            args = apply_yaml_defaults(parser, _subparser(parser, args.command), argv, args)
        except ValueError as e:
            parser.exit(2, f"asyncengine {args.command}: error: {e}\n")
    if getattr(args, "model_flag", None):
        if args.model and args.model != args.model_flag:
            parser.exit(2, f"asyncengine {args.command}: error: the model is given twice "
                           f"({args.model!r} and --model {args.model_flag!r})\n")
        args.model = args.model_flag
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench":
            if args.bench_command == "serve":
                from asyncengine.entrypoints.bench import serve as bench_serve

                return bench_serve.main(args)
            if args.bench_command == "overhead":
                from asyncengine.entrypoints.bench import overhead as bench_overhead

                return bench_overhead.main(args)
            if args.bench_command == "peers":
                from asyncengine.entrypoints.bench import peers as bench_peers

                return bench_peers.main(args)
            if args.bench_command == "models":
                from asyncengine.entrypoints.bench import models as bench_models

                return bench_models.main(args)
            if args.bench_command == "host":
                from asyncengine.entrypoints.bench import host as bench_host

                return bench_host.main(args)
            from asyncengine.entrypoints.bench import throughput as bench_throughput

            return bench_throughput.main(args)
        config = EngineConfig.from_cli(args)
        if config.parallel.node_rank > 0:  # a worker-only node of a multi-node group
            from asyncengine.executor.parallel.launch import serve_worker_node

            return serve_worker_node(config)
        if args.command == "serve":
            from asyncengine.entrypoints.http.server import main as serve_main

            return serve_main(args, config)
        if args.command == "run-batch":
            from asyncengine.entrypoints.batch.offline import main as run_batch

            return run_batch(args, config)
        return _generate(args, config)
    except ValueError as e:
        parser.exit(2, f"asyncengine {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


def _generate(args: argparse.Namespace, config: EngineConfig) -> int:
    import anyio

    from asyncengine.core.sampling_params import SamplingParams
    from asyncengine.engine.engine import AsyncEngine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    engine = AsyncEngine(config)
    prompt: str | list[int] = args.prompt
    if not args.raw:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)

    async def run() -> None:
        async with engine:
            async for out in engine.generate(prompt, params):
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    anyio.run(run)
    return 0
