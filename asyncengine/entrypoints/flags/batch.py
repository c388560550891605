"""The Batch API's flags: where batches live, how large an upload, how many lines in
flight."""

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

