"""The batch sender: pushed SSE frames sent by a native thread, in order per connection,
whatever the socket's buffer does; the descriptors it holds are closed; the server streams
the same bytes with it as without it."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from asyncengine.entrypoints.http.sender import BatchSender, _native


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def start_sender() -> BatchSender:
    sender = BatchSender.start()
    if sender is None:
        pytest.skip("the batch sender cannot be built here")
    return sender


_KEEP: list[object] = []


async def connected_pair() -> tuple[asyncio.Transport, asyncio.StreamReader, asyncio.Server]:
    """A server-side transport (what aiohttp writes to) and the client's reader."""
    loop = asyncio.get_running_loop()
    made: asyncio.Future[asyncio.Transport] = loop.create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport):
            made.set_result(transport)

    server = await loop.create_server(Server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    _KEEP[:] = [writer]  # a collected writer would close the connection
    return await made, reader, server


def test_frames_arrive_in_order_when_the_socket_fills_and_they_are_diverted():
    async def main():
        sender = start_sender()
        transport, reader, server = await connected_pair()
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # fills fast
        conn = sender.connect(transport)
        expected = bytearray()
        for step in range(300):
            frame = chunk(b"data: %d " % step + b"x" * (step % 7 * 300) + b"\n\n")
            expected += frame
            # What SSEStream.write_now does with a pushed frame.
            if sender.can_take(conn):
                sender.add(conn, conn.key + frame)
            else:
                transport.write(frame)
            if step % 5 == 4:
                sender.flush()
                await asyncio.sleep(0)  # completions come back between steps
        sender.flush()
        got = await asyncio.wait_for(reader.readexactly(len(expected)), 30)
        await asyncio.wait_for(sender.idle(conn), 10)
        assert got == expected
        assert sender.num_diverted > 0 and sender.num_sent > 0  # both paths were taken
        assert conn.inflight == 0 and not conn.diverted and not conn.broken
        sender.release(conn)
        assert conn.fd == -1
        sender.close()
        transport.close()
        server.close()

    asyncio.run(main())


def test_a_client_that_leaves_breaks_its_connection_and_the_descriptor_is_closed():
    async def main():
        sender = start_sender()
        transport, reader, server = await connected_pair()
        conn = sender.connect(transport)
        fd = conn.fd
        sender.add(conn, conn.key + chunk(b"data: 1\n\n"))
        sender.flush()
        assert (await asyncio.wait_for(reader.readexactly(3), 10)).startswith(b"9\r\n")
        await sender.idle(conn)
        # The client goes away (a reset); the stream ends while a frame is still in flight.
        reader._transport.get_extra_info("socket").setsockopt(  # type: ignore[attr-defined]
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        reader._transport.close()  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
        for _ in range(50):  # some sends may still succeed until the reset is seen
            if not sender.can_take(conn):
                break
            sender.add(conn, conn.key + chunk(b"data: 2\n\n" * 100))
            sender.flush()
            await asyncio.sleep(0.01)
        sender.release(conn)
        await asyncio.wait_for(sender.idle(conn), 10)
        assert conn.broken and conn.fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (and not reused by now: nothing else opened meanwhile)
        sender.close()
        transport.close()
        server.close()

    asyncio.run(main())


def test_close_settles_frames_still_in_flight():
    async def main():
        sender = start_sender()
        transport, reader, server = await connected_pair()
        conn = sender.connect(transport)
        for i in range(10):
            sender.add(conn, conn.key + chunk(b"data: %d\n\n" % i))
        sender.close()  # flushes, sends what is queued, stops the thread
        assert conn.inflight == 0
        sender.release(conn)
        assert conn.fd == -1
        expected = b"".join(chunk(b"data: %d\n\n" % i) for i in range(10))
        assert await asyncio.wait_for(reader.readexactly(len(expected)), 10) == expected
        transport.close()
        server.close()

    asyncio.run(main())


def test_the_server_streams_the_same_events_through_the_sender(tiny_llama, monkeypatch):
    """Streamed completions from a real engine: the sender sends the pushed frames, and the
    events equal the ones a server without it sends (ASYNCENGINE_BATCH_SEND=0)."""
    import anyio
    from aiohttp.test_utils import TestClient, TestServer

    from asyncengine.config import EngineConfig
    from asyncengine.engine.engine import AsyncEngine
    from asyncengine.entrypoints.http.app import build_app
    from asyncengine.entrypoints.http.state import STATE, ServerSettings

    if _native() is None:
        pytest.skip("the batch sender cannot be built here")

    async def run(enabled: bool) -> tuple[list[list[str]], int]:
        monkeypatch.setenv("ASYNCENGINE_BATCH_SEND", "1" if enabled else "0")
        engine = AsyncEngine(EngineConfig.from_dict({"model": tiny_llama, "dtype": "float32",
                                                     "num_gpu_blocks_override": 128}))
        async with engine:
            app = build_app(engine, None, ServerSettings())
            async with TestClient(TestServer(app)) as client:
                sender = app[STATE].sender
                assert (sender is not None) == enabled

                async def one(i: int) -> list[str]:
                    body = {"prompt": f"story {i}", "max_tokens": 24, "temperature": 0,
                            "ignore_eos": True, "stream": True}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status == 200
                    text = (await r.read()).decode()
                    return [e for e in text.split("\n\n") if e]

                results = [None] * 8

                async def keep(i: int) -> None:
                    results[i] = await one(i)

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        for i in range(8):
                            tg.start_soon(keep, i)
                sent = sender.num_sent + sender.num_diverted if sender else 0
            assert engine.num_unfinished_requests == 0
            assert engine.num_free_blocks == engine.num_total_blocks
        return results, sent

    def strip_ids(events: list[str]) -> list[str]:
        import json

        out = []
        for e in events:
            if e == "data: [DONE]":
                out.append(e)
                continue
            obj = json.loads(e.removeprefix("data: "))
            obj.pop("id"), obj.pop("created")
            out.append(json.dumps(obj, sort_keys=True))
        return out

    with_sender, sent = anyio.run(run, True)
    without, _ = anyio.run(run, False)
    assert sent > 8 * 10  # most steps' frames went through the thread
    assert [strip_ids(e) for e in with_sender] == [strip_ids(e) for e in without]
