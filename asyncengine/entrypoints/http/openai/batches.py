"""The Batch API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{batch_id},
POST /v1/batches/{batch_id}/cancel, in OpenAI's shapes (as SGLang serves them).

Creating a batch checks its whole input file first (off the loop): a file that is not JSONL,
a line whose ``url`` is not the batch's endpoint, or two lines with one ``custom_id`` are a
400 naming the line, and no batch is made. The batch then runs in the server
(``entrypoints/batch/runner.py``) at a lower priority than interactive requests.
"""

from __future__ import annotations

import time

from aiohttp import web

from asyncengine.entrypoints.batch.journal import BadInput
from asyncengine.entrypoints.batch.protocol import (
    COMPLETION_WINDOW_S,
    UNFINISHED,
    Batch,
    BatchList,
    BatchListQuery,
    BatchRecord,
    CreateBatchRequest,
    RequestCounts,
)
from asyncengine.entrypoints.batch.service import batches_of
from asyncengine.entrypoints.batch.store import BatchStore, new_id
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.openai.files import file_of, from_bad_input, read_query
from asyncengine.entrypoints.http.openapi import Route
from asyncengine.entrypoints.http.serving import json_response, read_body
from asyncengine.entrypoints.http.tenancy import current_tenant


def record_of(store: BatchStore, batch_id: str) -> BatchRecord:
    record = store.batches.get(batch_id)
    if record is None:
        raise APIError(404, f"No such batch: {batch_id!r}.", param="batch_id",
                       code="batch_not_found")
    return record


async def create_batch(request: web.Request) -> web.Response:
    store, runner = batches_of(request)
    body = await read_body(request, CreateBatchRequest)
    f = file_of(store, body.input_file_id, "input_file_id")
    if f.purpose != "batch":
        raise bad_request(f"The file {f.id!r} was not uploaded with purpose 'batch'.",
                          "input_file_id")
    try:
        total = await store.scan(f.id, body.endpoint)
    except BadInput as e:
        raise from_bad_input(e, "input_file_id") from None
    now = int(time.time())
    batch = Batch(id=new_id("batch_"), endpoint=body.endpoint, input_file_id=f.id,
                  completion_window=body.completion_window, status="in_progress",
                  created_at=now, in_progress_at=now, expires_at=now + COMPLETION_WINDOW_S,
                  request_counts=RequestCounts(total=total), metadata=body.metadata)
    record = BatchRecord(batch=batch, output_file_id=new_id("file-"),
                         error_file_id=new_id("file-"), created_ns=time.time_ns(),
                         tenant=current_tenant.get())
    await store.save(record)
    runner.start(record)
    return json_response(batch)


async def list_batches(request: web.Request) -> web.Response:
    store, _ = batches_of(request)
    query = read_query(request, BatchListQuery)
    batches = [r.batch for r in reversed(store.batches.values())]  # the newest first
    if query.after is not None:
        ids = [b.id for b in batches]
        batches = batches[ids.index(query.after) + 1:] if query.after in ids else []
    page = batches[:query.limit]
    return json_response(BatchList(data=page, has_more=len(batches) > len(page),
                                   first_id=page[0].id if page else None,
                                   last_id=page[-1].id if page else None))


async def retrieve_batch(request: web.Request) -> web.Response:
    store, _ = batches_of(request)
    return json_response(record_of(store, request.match_info["batch_id"]).batch)


async def cancel_batch(request: web.Request) -> web.Response:
    store, runner = batches_of(request)
    record = record_of(store, request.match_info["batch_id"])
    status = record.batch.status
    if status not in UNFINISHED or status == "finalizing":
        raise bad_request(f"The batch {record.batch.id!r} is {status}: only a batch still "
                          "running its lines can be cancelled.", "batch_id")
    if status != "cancelling":
        await runner.cancel(record)
    return json_response(record.batch)


BATCH_ROUTES = [
    Route("POST", "/v1/batches", create_batch, "Create a batch from an uploaded JSONL file",
          CreateBatchRequest, Batch),
    Route("GET", "/v1/batches", list_batches, "List the batches, the newest first",
          response=BatchList, query=BatchListQuery),
    Route("GET", "/v1/batches/{batch_id}", retrieve_batch, "Describe a batch", response=Batch),
    Route("POST", "/v1/batches/{batch_id}/cancel", cancel_batch, "Cancel a batch",
          response=Batch),
]
