"""``asyncengine run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [engine flags]``: a batch file
run offline, as vLLM's ``run-batch``.

No server listens: the engine runs in this process and each line goes through
``lines.execute``, as a line of a server's batch does. ``-`` is stdin (``-i``) or stdout
(``-o``). The file is checked whole before the model loads (JSONL, each ``url`` one of the
batch endpoints, no ``custom_id`` twice); a bad file exits 1 naming its line. Lines run
``--max-num-seqs`` at a time; each result is appended to a journal in ``--output-tmp-dir`` as
it finishes, and the output is written at the end in the input's order, the failed lines
too (with ``error`` set). A progress bar goes to stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.batch import journal
from asyncengine.entrypoints.batch.journal import BadInput
from asyncengine.entrypoints.batch.lines import Retry, execute
from asyncengine.entrypoints.batch.protocol import InputLine
from asyncengine.entrypoints.batch.runner import READ_CHUNK, RETRY_S, Admission
from asyncengine.entrypoints.http.state import ServerSettings, ServerState

logger = logging.getLogger("asyncengine.entrypoints.batch")
_ENCODE = msgspec.json.Encoder()


def settings_of(args: argparse.Namespace) -> ServerSettings:
    """What shapes a line's answer, from run-batch's flags; ValueError names a bad flag."""
    from asyncengine.text.tool_parsers import TOOL_PARSERS

    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {args.tool_call_parser!r} "
                         f"(known: {', '.join(sorted(TOOL_PARSERS))})")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.reasoning_parser:
        from asyncengine.ext.registry import resolve_reasoning_parser

        resolve_reasoning_parser(args.reasoning_parser)
    kwargs = {}
    if args.default_chat_template_kwargs:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs: must be a JSON object")
    return ServerSettings(enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser or None,
                          default_chat_template_kwargs=kwargs,
                          prompt_tokens_details=args.enable_prompt_tokens_details)


def main(args: argparse.Namespace, config: EngineConfig) -> int:
    settings = settings_of(args)
    for name in ("enable_metrics", "url", "port"):
        if getattr(args, name):
            print(f"asyncengine run-batch: --{name.replace('_', '-')} is accepted for vLLM "
                  "compatibility and ignored (no metrics server runs offline)", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="asyncengine-run-batch-", dir=args.output_tmp_dir))
    try:
        return anyio.run(run, args, config, settings, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def run(args: argparse.Namespace, config: EngineConfig, settings: ServerSettings,
              work: Path) -> int:
    from asyncengine.engine.engine import AsyncEngine

    source = Path(args.input_file)
    if args.input_file == "-":
        source = work / "input.jsonl"
        await anyio.to_thread.run_sync(_save_stdin, source)
    try:
        total = await anyio.to_thread.run_sync(journal.scan_input, source, None)
    except (BadInput, OSError) as e:
        print(f"asyncengine run-batch: {args.input_file}: {e}", file=sys.stderr)
        return 1
    engine = AsyncEngine(config)  # loads the model (nothing else runs yet)
    state = ServerState(engine, None, settings)
    results = work / "results.jsonl"
    sink = journal.Journal(results)
    bar = _progress(total)
    failed = 0
    async with engine, anyio.create_task_group() as tg:
        admission = Admission(engine, config.scheduler.max_num_seqs,
                              yield_to_interactive=False)

        async def one(line: InputLine) -> None:
            nonlocal failed
            try:
                while True:
                    try:
                        out = await execute(state, line, priority=0)
                        break
                    except Retry:
                        if engine.error is not None:
                            tg.cancel_scope.cancel()
                            return
                        await anyio.sleep(RETRY_S)
                await anyio.to_thread.run_sync(sink.append, _ENCODE.encode(out) + b"\n")
                failed += out.error is not None
                bar.update(1)
            finally:
                admission.release()

        offset = 0
        while True:
            lines, offset = await anyio.to_thread.run_sync(journal.read_lines, source, offset,
                                                           READ_CHUNK)
            if not lines:
                break
            for line in lines:
                await admission.acquire()
                tg.start_soon(one, line)
    bar.close()
    sink.close()
    if engine.error is not None:
        print(f"asyncengine run-batch: the engine failed: {engine.error}", file=sys.stderr)
        return 1
    await anyio.to_thread.run_sync(_write_output, source, results, args.output_file)
    print(f"asyncengine run-batch: {total} requests, {total - failed} answered, {failed} "
          "failed", file=sys.stderr)
    return 0


def _save_stdin(dest: Path) -> None:
    with open(dest, "wb") as out:
        shutil.copyfileobj(sys.stdin.buffer, out, 1 << 20)


def _write_output(source: Path, results: Path, output: str) -> None:
    if output == "-":
        journal.write_ordered(source, [results], sys.stdout.buffer)
        sys.stdout.buffer.flush()
    else:
        journal.write_ordered_file(source, [results], Path(output))


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int):
    if not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="run-batch", file=sys.stderr)
