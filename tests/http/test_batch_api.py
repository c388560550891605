"""The Batch API against the real server, with the official openai client: upload, create,
poll, download; every refused input a 4xx in OpenAI's shape; a bad line in the error file
while the rest goes on; cancelling; a server killed mid-batch resuming it with every line
exactly once; and, without a server, the disk layer's recovery of a torn line and the
admission of lines beside interactive requests."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import anyio
import openai
import pytest

from asyncengine.entrypoints.batch import journal
from asyncengine.entrypoints.batch.runner import Admission
from tests.server_utils import KEY, ServerProcess

MAX_FILE = 64 * 1024


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def killed(tiny_llama, batch_dir) -> tuple[str, list[dict]]:
    """A server on ``batch_dir`` killed (SIGKILL) in the middle of a batch, and a torn line
    at the end of its journal: the batch's id and lines. The module's server resumes it."""
    first = ServerProcess(tiny_llama, "--batch-dir", str(batch_dir),
                          "--num-gpu-blocks-override", "1024", api_key=KEY)
    c = openai.OpenAI(base_url=first.url("/v1"), api_key=KEY, max_retries=0, timeout=60)
    lines = [chat_line(i, tiny_llama, max_tokens=8, ignore_eos=True) for i in range(48)]
    batch = create(c, upload(c, jsonl(lines)).id)
    deadline = time.monotonic() + 120
    while c.batches.retrieve(batch.id).request_counts.completed < 8:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.proc.kill()  # no drain: the lines in flight are lost
    first.proc.wait()
    first.stop()
    output = batch_dir / "batches" / f"{batch.id}.output.jsonl"
    assert 8 <= len(journal.recover(output)) < len(lines)
    with open(output, "ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "req-47", "resp')  # a torn write
    return batch.id, lines


@pytest.fixture(scope="module")
def server(tiny_llama, batch_dir, killed):
    s = ServerProcess(tiny_llama, "--batch-dir", str(batch_dir), "--max-batch-file-size",
                      str(MAX_FILE), "--num-gpu-blocks-override", "1024", api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return tiny_llama  # the served name: the model's path


def chat_line(i: int, model: str, max_tokens: int = 3, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": f"Tell me about {i}."}], **body}}


def alone(client: openai.OpenAI, body: dict):
    """The chat completion of ``body`` sent by itself (vLLM's options as extra_body)."""
    extra = {k: body[k] for k in ("ignore_eos",) if k in body}
    return client.chat.completions.create(**{k: v for k, v in body.items() if k not in extra},
                                          extra_body=extra or None)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, data: bytes):
    return client.files.create(file=("batch.jsonl", data), purpose="batch")


def wait(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def read_lines(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_the_openai_client_runs_a_batch_end_to_end(client, model):
    lines = [chat_line(i, model, max_tokens=2) for i in range(200)]
    f = upload(client, jsonl(lines))
    assert (f.object, f.purpose, f.status, f.bytes) == ("file", "batch", "processed",
                                                         len(jsonl(lines)))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "e2e"})
    assert batch.object == "batch" and batch.request_counts.total == 200
    assert batch.metadata == {"run": "e2e"} and batch.status == "in_progress"
    batch = wait(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (200, 0)
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    out = read_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(200)]  # input order
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert set(o["response"]) == {"status_code", "request_id", "body"}
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["id"] == o["response"]["request_id"]
    meta = client.files.retrieve(batch.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(
        client.files.content(batch.output_file_id).content)
    for line, o in zip(lines, out, strict=True):  # greedy: the same as sent alone
        one = alone(client, line["body"])
        body = o["response"]["body"]
        assert body["choices"][0]["message"]["content"] == one.choices[0].message.content
        assert body["choices"][0]["finish_reason"] == one.choices[0].finish_reason
        assert body["usage"]["completion_tokens"] == one.usage.completion_tokens


def refused(call, status: int) -> dict:
    """The OpenAI-style error body of a call the server refuses with ``status``."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status, info.value
    error = info.value.body
    assert set(error) == {"message", "type", "param", "code"}, error  # the client unwraps it
    return error


def create(client, file_id: str, endpoint: str = "/v1/chat/completions"):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                 completion_window="24h")


def test_bad_inputs_are_4xx_in_openai_s_shape(client, model):
    not_jsonl = upload(client, b'{"custom_id": "a", "method": "POST"\nnot json at all\n')
    error = refused(lambda: create(client, not_jsonl.id), 400)
    assert error["code"] == "invalid_jsonl" and "line 1" in error["message"]
    wrong_url = upload(client, jsonl([chat_line(0, model), {**chat_line(1, model),
                                                            "url": "/v1/embeddings"}]))
    error = refused(lambda: create(client, wrong_url.id), 400)
    assert error["code"] == "invalid_url" and "line 2" in error["message"]
    twice = upload(client, jsonl([chat_line(0, model), chat_line(1, model),
                                  chat_line(0, model)]))
    error = refused(lambda: create(client, twice.id), 400)
    assert error["code"] == "duplicate_custom_id" and "'req-0'" in error["message"]
    error = refused(lambda: upload(client, b"x" * (MAX_FILE + 1)), 413)
    assert error["code"] == "file_too_large" and error["param"] == "file"
    error = refused(lambda: create(client, "file-missing"), 404)
    assert error["param"] == "input_file_id"
    refused(lambda: create(client, twice.id, "/v1/responses"), 400)  # not a batch endpoint
    refused(lambda: client.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune"), 400)
    refused(lambda: client.batches.retrieve("batch_missing"), 404)
    refused(lambda: client.files.content("file-missing"), 404)
    refused(lambda: client.batches.list(limit=0), 400)
    # Every route is behind the API key.
    anonymous = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    refused(lambda: anonymous.files.list(), 401)
    refused(lambda: anonymous.batches.create(input_file_id=twice.id,
                                             endpoint="/v1/chat/completions",
                                             completion_window="24h"), 401)


def test_a_bad_line_gets_an_error_record_and_the_rest_goes_on(client, model):
    lines = [chat_line(0, model), chat_line(1, model, max_tokens=-1),
             {**chat_line(2, model), "body": {"messages": "not a list"}},
             chat_line(3, model), {**chat_line(4, model), "body": {**chat_line(4, model)["body"],
                                                                   "model": "nope"}}]
    batch = wait(client, create(client, upload(client, jsonl(lines)).id).id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    assert [o["custom_id"] for o in read_lines(client, batch.output_file_id)] == \
        ["req-0", "req-3"]
    errors = read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == ["req-1", "req-2", "req-4"]
    statuses = [e["response"]["status_code"] for e in errors]
    assert statuses == [400, 400, 404]
    for e in errors:
        assert e["error"]["message"] == e["response"]["body"]["error"]["message"]
    assert errors[0]["response"]["body"]["error"]["param"] == "max_tokens"
    assert errors[2]["error"]["code"] == "model_not_found"


def test_other_endpoints_and_streaming_lines(client, model):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"Once {i}", "max_tokens": 3,
                       "temperature": 0, "stream": i == 1}} for i in range(3)]
    batch = wait(client, create(client, upload(client, jsonl(lines)).id, "/v1/completions").id)
    out = read_lines(client, batch.output_file_id)
    for line, o in zip(lines, out, strict=True):
        alone = client.completions.create(**{**line["body"], "stream": False})
        assert o["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": model, "input": f"text {i}"}} for i in range(3)]
    batch = wait(client, create(client, upload(client, jsonl(lines)).id, "/v1/embeddings").id)
    out = read_lines(client, batch.output_file_id)
    alone = client.embeddings.create(model=model, input="text 2", encoding_format="float")
    assert out[2]["response"]["body"]["data"][0]["embedding"] == pytest.approx(
        alone.data[0].embedding, abs=1e-6)


def test_cancel_files_and_listing(client, model):
    earlier = wait(client, create(client, upload(client, jsonl([chat_line(0, model)])).id).id)
    lines = [chat_line(i, model, max_tokens=200, ignore_eos=True) for i in range(40)]
    f = upload(client, jsonl(lines))
    batch = create(client, f.id)
    error = refused(lambda: client.files.delete(f.id), 409)  # a running batch reads it
    assert error["code"] == "file_in_use"
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = wait(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts.completed < 40  # the rest never ran
    assert len(read_lines(client, batch.output_file_id)) == batch.request_counts.completed
    error = refused(lambda: client.batches.cancel(batch.id), 400)  # it has ended
    assert error["param"] == "batch_id"
    assert client.files.delete(f.id).deleted
    refused(lambda: client.files.retrieve(f.id), 404)
    assert f.id not in [x.id for x in client.files.list()]
    newest = client.batches.list(limit=2)
    assert [b.id for b in newest.data] == [batch.id, earlier.id]
    after = client.batches.list(limit=2, after=newest.data[-1].id)
    assert not {b.id for b in after.data} & {b.id for b in newest.data}
    every = [b.id for b in client.batches.list(limit=1)]  # the client pages with after
    assert every[:2] == [batch.id, earlier.id] and len(every) == len(set(every))


def test_a_killed_server_resumes_its_batch_with_each_line_once(client, killed):
    batch_id, lines = killed  # the module's server started on the killed one's --batch-dir
    batch = wait(client, batch_id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0)
    out = read_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]
    for line, o in zip(lines, out, strict=True):
        assert o["response"]["body"]["choices"][0]["message"]["content"] == \
            alone(client, line["body"]).choices[0].message.content


def test_journal_recovery_and_the_copy_in_input_order(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line(i, "m") for i in range(4)]) + b"\n")
    assert journal.scan_input(source, "/v1/chat/completions") == 4
    j = journal.Journal(tmp_path / "j.jsonl")
    for i in (2, 0, 2):  # a line written twice is copied once
        j.append(json.dumps({"id": "x", "custom_id": f"req-{i}", "response": None}).encode()
                 + b"\n")
    j.append(b'{"id": "x", "custom_id": "req-3"')  # torn
    j.close()
    assert journal.recover(tmp_path / "j.jsonl") == ["req-2", "req-0", "req-2"]
    assert (tmp_path / "j.jsonl").read_bytes().endswith(b"}\n")
    out = io.BytesIO()
    journal.write_ordered(source, [tmp_path / "j.jsonl"], out)
    assert [json.loads(x)["custom_id"] for x in out.getvalue().splitlines()] == \
        ["req-0", "req-2"]


def test_admission_bounds_the_batch_and_yields_to_interactive_requests():
    class Engine:
        running = waiting = 0

        def stats(self):
            return SimpleNamespace(num_running=self.running, num_waiting=self.waiting)

    engine, paused = Engine(), [False]
    admission = Admission(engine, 2, grace_s=0.2, paused=lambda: paused[0])

    async def main() -> None:
        await admission.acquire()
        with admission.running():
            engine.running = 1  # the line's own request
            assert admission._may_start()
            engine.waiting = 1  # another one: interactive
            assert not admission._may_start()
            engine.waiting = 0
            assert not admission._may_start()  # for grace_s after it
            await anyio.sleep(0.25)
            assert admission._may_start()
            paused[0] = True  # the server drains
            assert not admission._may_start()
            paused[0] = False
            await admission.acquire()
            assert not admission._may_start()  # the limit
            with anyio.fail_after(1):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(admission.acquire)
                    await anyio.sleep(0.05)
                    admission.release()  # the waiting acquire gets the slot
        assert admission.in_flight == 2 and admission.in_engine == 0

    anyio.run(main)
