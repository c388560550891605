"""The Batch API's objects, in OpenAI's shapes: files, batches, the lines of their files.

The same Structs are what the server writes to ``--batch-dir`` (a batch's record adds what
only the server needs: the ids its output and error files will have, its tenant).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from asyncengine.entrypoints.http.protocol import Body

#: The routes a batch may run, each line's ``url`` being its batch's ``endpoint``.
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed",
                      "expired", "cancelling", "cancelled"]
#: Statuses a batch leaves only by running on (a restart resumes it).
UNFINISHED = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
#: OpenAI's only window: a batch not done 24 hours after its creation expires.
COMPLETION_WINDOW_S = 24 * 3600

FilePurpose = Literal["batch", "batch_output", "vision", "user_data"]
# OpenAI's metadata: up to 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)],
                          Annotated[str, Meta(max_length=512)]], Meta(max_length=16)]
ObjectId = Annotated[str, Meta(min_length=1, max_length=256)]


# -- files -------------------------------------------------------------------------------------
class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    object: Literal["file"] = "file"


class FileList(Struct, kw_only=True):
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class FileDeleted(Struct, kw_only=True):
    id: str
    deleted: bool
    object: Literal["file"] = "file"


class FileUpload(Struct, kw_only=True, forbid_unknown_fields=True):
    """The form of POST /v1/files (multipart/form-data)."""

    file: Annotated[str, Meta(description="The file: for purpose batch, JSONL (one request "
                                          "a line); for vision or user_data, an image "
                                          "(input_image's file_id in /v1/responses)")]
    purpose: Literal["batch", "vision", "user_data"]


class FileListQuery(Body, kw_only=True):
    purpose: FilePurpose | None = None
    limit: Annotated[int, Meta(ge=1, le=10000)] = 10000
    after: ObjectId | None = None
    order: Literal["asc", "desc"] = "desc"


# -- batches -----------------------------------------------------------------------------------
class CreateBatchRequest(Body, kw_only=True):
    input_file_id: ObjectId
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: Metadata | None = None


class BatchListQuery(Body, kw_only=True):
    limit: Annotated[int, Meta(ge=1, le=100)] = 20
    after: ObjectId | None = None


class RequestCounts(Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class Batch(Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    object: Literal["batch"] = "batch"


class BatchList(Struct, kw_only=True):
    data: list[Batch]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class BatchRecord(Struct, kw_only=True):
    """A batch as ``--batch-dir`` keeps it: the object clients see, plus the ids its output
    and error files take when it ends, and the tenant its lines are accounted to."""

    batch: Batch
    output_file_id: str
    error_file_id: str
    created_ns: int
    tenant: str | None = None


# -- the lines of a batch's files --------------------------------------------------------------
class InputLine(Struct, kw_only=True):
    custom_id: Annotated[str, Meta(min_length=1)]
    method: str
    url: str
    body: msgspec.Raw


class LineResponse(Struct, kw_only=True):
    status_code: int
    request_id: str
    body: Any


class LineError(Struct, kw_only=True):
    code: str
    message: str


class OutputLine(Struct, kw_only=True):
    """A line of the output file (``error`` None) or of the error file (``error`` set)."""

    id: str
    custom_id: str
    response: LineResponse | None
    error: LineError | None = None


class LineKey(Struct):
    """What resuming reads of a written line."""

    custom_id: str
