"""The Batch API's flags: ``serve``'s (where batches live, how large an upload, how many
lines in flight) and ``run-batch``'s own (vLLM's: ``-i``, ``-o``, ``--output-tmp-dir``...)."""

from __future__ import annotations

import argparse
from typing import Any

from asyncengine.config import parse_size
from asyncengine.entrypoints.http.state import DEFAULT_MAX_BATCH_FILE_SIZE


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Batch API", "/v1/files and /v1/batches")
    g.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="keep uploaded files and batches here, written atomically: a restart "
                        "resumes the unfinished batches (default: a temporary directory, "
                        "removed at exit)")
    g.add_argument("--max-batch-file-size", default=None, metavar="SIZE",
                   help="largest file POST /v1/files takes, e.g. 200MiB (default: 200MiB); "
                        "larger uploads get 413")
    g.add_argument("--max-batch-concurrency", type=int, default=None, metavar="N",
                   help="most batch lines in flight at once, over all batches (default: "
                        "--max-num-seqs / 8, at least 1); none starts while an interactive "
                        "request waits")


def batch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``ServerSettings`` fields from the flags above (their defaults when a parser lacks
    them). Raises ValueError naming the flag."""
    size = getattr(args, "max_batch_file_size", None)
    concurrency = getattr(args, "max_batch_concurrency", None)
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--max-batch-concurrency: must be at least 1, got {concurrency}")
    return {"batch_dir": getattr(args, "batch_dir", None),
            "max_batch_file_size": (DEFAULT_MAX_BATCH_FILE_SIZE if size is None
                                    else parse_size(size, "max_batch_file_size")),
            "max_batch_concurrency": concurrency}


def add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``run-batch`` flags, and the server's flags that shape what a line answers."""
    g = parser.add_argument_group("run-batch", "the batch file (vLLM's flags)")
    g.add_argument("-i", "--input-file", required=True, metavar="PATH",
                   help="the batch: JSONL, one request a line ({custom_id, method, url, "
                        "body}); - reads stdin")
    g.add_argument("-o", "--output-file", required=True, metavar="PATH",
                   help="where each line's result goes, in the input's order (errors "
                        "included, with 'error' set); - writes stdout")
    g.add_argument("--output-tmp-dir", default=None, metavar="DIR",
                   help="where results wait until they are written in order (default: the "
                        "system's temporary directory)")
    g.add_argument("--enable-metrics", action="store_true",
                   help="accepted for vLLM compatibility: no metrics server runs offline")
    g.add_argument("--url", default=None, help="accepted for vLLM compatibility (the metrics "
                   "server's address): ignored")
    g.add_argument("--port", type=int, default=None, help="accepted for vLLM compatibility "
                   "(the metrics server's port): ignored")
    g.add_argument("--response-role", default="assistant", choices=["assistant"],
                   help="the role of chat answers (vLLM's flag; only assistant)")
    f = parser.add_argument_group("responses", "as asyncengine serve takes them")
    f.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": parse tool calls with --tool-call-parser')
    f.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the format of the model's tool calls (hermes, llama3_json)")
    f.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a reasoning model's thinking from its answer")
    f.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="chat_template_kwargs every line starts from")
    f.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in chat and completions")
    f.add_argument("--log-level", default="warning",
                   choices=("debug", "info", "warning", "error", "critical"),
                   help="log level (default: warning)")
