"""The Files API: POST /v1/files (purpose ``batch``: a batch's input; ``vision`` or
``user_data``: an image /v1/responses reads by its file id), GET /v1/files, GET and DELETE
/v1/files/{file_id}, GET /v1/files/{file_id}/content.

An upload is ``multipart/form-data`` (what the openai client sends); its file is streamed to
disk as it arrives and refused (413) past ``--max-batch-file-size``, so no upload is ever held
in memory. Contents are checked when a batch uses them (``POST /v1/batches``). A file that an
unfinished batch reads cannot be deleted (409).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from asyncengine.entrypoints.batch.journal import BadInput
from asyncengine.entrypoints.batch.protocol import (
    FileDeleted,
    FileList,
    FileListQuery,
    FileObject,
    FileUpload,
)
from asyncengine.entrypoints.batch.service import batches_of
from asyncengine.entrypoints.batch.store import BatchStore
from asyncengine.entrypoints.http.errors import APIError, bad_request, from_decode_error
from asyncengine.entrypoints.http.openapi import Route
from asyncengine.entrypoints.http.serving import json_response

Q = TypeVar("Q")
#: What an upload may be for: a batch's input, or an image /v1/responses reads by file id.
UPLOAD_PURPOSES = ("batch", "vision", "user_data")
_CHUNK = 1 << 16
#: The longest ``purpose`` field read.
_MAX_FIELD = 256


def read_query(request: web.Request, type_: type[Q]) -> Q:
    """The query string as ``type_`` (a 400 naming the parameter when it does not fit)."""
    try:
        return msgspec.convert(dict(request.query), type_, strict=False)
    except msgspec.ValidationError as e:
        raise from_decode_error(e) from None


def from_bad_input(e: BadInput, param: str | None = None) -> APIError:
    return APIError(e.status, e.message, param=e.param or param, code=e.code)


def file_of(store: BatchStore, file_id: str, param: str = "file_id") -> FileObject:
    f = store.files.get(file_id)
    if f is None:
        raise APIError(404, f"No such file: {file_id!r}.", param=param, code="file_not_found")
    return f


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(_CHUNK):
        yield chunk


async def _field(part: BodyPartReader) -> str:
    data = b""
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > _MAX_FIELD:
            raise bad_request(f"The field {part.name!r} is too long.", part.name)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise bad_request(f"The field {part.name!r} is not UTF-8 text.", part.name) from None


async def create_file(request: web.Request) -> web.Response:
    store, _ = batches_of(request)
    if request.content_type != "multipart/form-data":
        raise bad_request("Upload a file as multipart/form-data, with the fields 'file' and "
                          "'purpose'.", "file")
    purpose: str | None = None
    upload: tuple[str, int] | None = None
    filename = "upload.jsonl"
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                await part.release()
            elif part.name == "file" and upload is None:
                filename = part.filename or filename
                upload = await store.receive(_chunks(part), filename)
            elif part.name == "purpose" and purpose is None:
                purpose = await _field(part)
            else:  # unlike a JSON body's, refused (the document says so: a form's field
                # names are MIME headers, which refuse much of what JSON keys allow)
                raise bad_request(f"Unexpected field {part.name!r}: the form takes one "
                                  "'file' and one 'purpose'.", part.name)
    except BadInput as e:
        raise from_bad_input(e) from None
    except (ValueError, LookupError, AssertionError, RuntimeError,
            HttpProcessingError) as e:  # what aiohttp's multipart parser raises
        if upload is not None:
            await store.discard_upload(upload[0])
        raise bad_request(f"Cannot read the multipart body: {e}", "file") from None
    except BaseException:  # the unknown field's 400 too
        if upload is not None:
            await store.discard_upload(upload[0])
        raise
    if upload is None:
        raise bad_request("The field 'file' is missing: the file to upload.", "file")
    if purpose not in UPLOAD_PURPOSES:
        await store.discard_upload(upload[0])
        raise bad_request(f"purpose must be one of {', '.join(map(repr, UPLOAD_PURPOSES))} "
                          f"(batch: a batch's input; vision, user_data: an image a response "
                          f"reads by its file id), got {purpose!r}.", "purpose")
    return json_response(await store.add_file(upload[0], filename, purpose, upload[1]))


async def list_files(request: web.Request) -> web.Response:
    store, _ = batches_of(request)
    query = read_query(request, FileListQuery)
    files = [f for f in store.files.values() if query.purpose in (None, f.purpose)]
    if query.order == "desc":
        files.reverse()
    if query.after is not None:
        ids = [f.id for f in files]
        files = files[ids.index(query.after) + 1:] if query.after in ids else []
    page = files[:query.limit]
    return json_response(FileList(data=page, has_more=len(files) > len(page),
                                  first_id=page[0].id if page else None,
                                  last_id=page[-1].id if page else None))


async def retrieve_file(request: web.Request) -> web.Response:
    store, _ = batches_of(request)
    return json_response(file_of(store, request.match_info["file_id"]))


async def file_content(request: web.Request) -> web.StreamResponse:
    store, _ = batches_of(request)
    f = file_of(store, request.match_info["file_id"])
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = f.bytes
    await response.prepare(request)
    async for chunk in store.read_content(f.id):
        await response.write(chunk)
    await response.write_eof()
    return response


async def delete_file(request: web.Request) -> web.Response:
    store, _ = batches_of(request)
    f = file_of(store, request.match_info["file_id"])
    if store.in_use(f.id):
        raise APIError(409, f"The file {f.id!r} is the input of a batch that has not ended; "
                            "cancel the batch first.", param="file_id", code="file_in_use")
    await store.delete_file(f.id)
    return json_response(FileDeleted(id=f.id, deleted=True))


FILE_ROUTES = [
    Route("POST", "/v1/files", create_file, "Upload a file (purpose batch: a batch's input; "
          "vision, user_data: an image for /v1/responses)",
          FileUpload, FileObject, body_type="multipart/form-data"),
    Route("GET", "/v1/files", list_files, "List the files", response=FileList,
          query=FileListQuery),
    Route("GET", "/v1/files/{file_id}", retrieve_file, "Describe a file", response=FileObject),
    Route("GET", "/v1/files/{file_id}/content", file_content, "A file's content",
          content_type="application/octet-stream"),
    Route("DELETE", "/v1/files/{file_id}", delete_file, "Delete a file", response=FileDeleted),
]
