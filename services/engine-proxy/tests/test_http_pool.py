"""engine-proxy's lean HTTP/1.1 client (_engines/_http.py) against real servers: the benchmark's stub
(uvicorn) for kept-alive reuse, and a raw asyncio server for what a server may do: chunked or
Content-Length answers in pieces, closing an idle connection, dying mid-answer, hanging, refusing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import uvloop

from examlops_devstack import free_port, wait_http
from examlops_engine_proxy._engines._http import HttpPool, NetFailure
from examlops_engine_proxy._engines._vllm_server import VllmServerEngine, net_failure

STUB = Path(__file__).resolve().parents[3] / "bench" / "stub_backend.py"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 15)
        yield url
    finally:
        proc.kill()
        proc.wait()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def dribble(writer: asyncio.StreamWriter, *pieces: bytes, pause_s: float = 0.02) -> None:
    """Write `pieces` as separate network writes, `pause_s` apart."""
    for i, piece in enumerate(pieces):
        if i:
            await asyncio.sleep(pause_s)
        writer.write(piece)
        await writer.drain()


async def ask_ok(p: HttpPool) -> None:
    """One request, its answer `ok` read whole, the connection given back."""
    answer = await p.post("/x", {}, b"{}")
    assert await answer.read() == b"ok"
    answer.release()


def pool(url: str, read_timeout_s: float = 5.0, max_connections: int = 8) -> HttpPool:
    return HttpPool(url, connect_timeout_s=1.0, read_timeout_s=read_timeout_s, max_connections=max_connections)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


async def serving(handler: Handler, run: Callable[[str], Awaitable[None]]) -> None:
    """`run(url)` with `handler` serving each connection at url (with a path prefix)."""
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await run(f"http://127.0.0.1:{port}/prefix")
    finally:
        server.close()
        for writer in writers:
            writer.transport.abort()
        await asyncio.sleep(0.01)


def test_answers_from_a_real_server_reuse_one_kept_alive_connection(stub: str) -> None:
    async def run() -> None:
        p = pool(stub)
        body = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
        for _ in range(50):
            answer = await p.post("/v1/chat/completions", {"Content-Type": "application/json"}, body)
            assert answer.status == 200 and b'"usage"' in await answer.read()
            answer.release()
        stream = body[:-1] + b',"stream":true}'
        answer = await p.post("/v1/chat/completions", {"Content-Type": "application/json"}, stream)
        got = b"".join([piece async for piece in answer.content.iter_any()])
        assert answer.content.at_eof() and got.endswith(b"data: [DONE]\n\n")
        answer.release()
        stats = await asyncio.to_thread(lambda: __import__("httpx").get(stub + "/stats").json())
        assert len(p.open) == 1 and stats["connections"] >= 1
        p.close()

    uvloop.run(run())


def test_chunked_and_sized_answers_arriving_in_pieces_are_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        assert request.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n") and b"x-test: 1" in request
        await dribble(writer, b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello", b" world")
        request = await read_request(reader)  # the same connection, kept alive
        await dribble(writer, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n",
                      b"3\r\n ok\r\n0\r\n\r\n")
        await reader.read()

    async def run(url: str) -> None:
        p = pool(url)
        answer = await p.post("/v1/completions", {"x-test": "1"}, b"{}")
        assert await answer.read() == b"hello world"
        answer.release()
        answer = await p.post("/v1/completions", {"x-test": "1"}, b"{}")
        pieces = [piece async for piece in answer.content.iter_any()]
        assert pieces == [b"data:", b" ok"] and answer.content.at_eof()
        answer.release()
        assert len(p.open) == 1
        p.close()

    uvloop.run(serving(handler, run))


@pytest.mark.parametrize("then", ["closes", "speaks unasked"])
def test_a_connection_the_server_closed_or_spoke_on_while_idle_is_not_reused(then: str) -> None:
    """uvicorn closes an idle kept-alive connection without a word; a broken server may write on
    one nobody asked anything of. Either way the next request goes on a new connection."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        if then == "closes":
            await dribble(writer, OK)
            writer.close()
            return
        await dribble(writer, OK, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray", pause_s=0.05)
        await reader.read()

    async def run(url: str) -> None:
        p = pool(url)
        for _ in range(3):
            await ask_ok(p)
            await asyncio.sleep(0.15)
        assert connections == 3
        p.close()

    uvloop.run(serving(handler, run))


def test_a_server_dying_mid_answer_hanging_or_refusing_is_a_classified_failure() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.transport.abort()

    async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def on_dies(url: str) -> None:
        p = pool(url)
        answer = await p.post("/x", {}, b"{}")
        with pytest.raises(NetFailure) as err:
            await answer.read()
        assert net_failure(err.value) == ("read", "server disconnected")
        answer.release()
        assert not p.open and not p.idle

    async def on_hangs(url: str) -> None:
        p = pool(url, read_timeout_s=0.2)
        started = time.monotonic()
        with pytest.raises(NetFailure) as err:
            await p.post("/x", {}, b"{}")
        assert net_failure(err.value) == ("timeout", "timed out waiting for the server")
        assert time.monotonic() - started < 2 and not p.open

    async def refused() -> None:
        p = pool(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(NetFailure) as err:
            await p.post("/x", {}, b"{}")
        assert net_failure(err.value) == ("connect", "connection refused") and not p.open

    uvloop.run(serving(dies, on_dies))
    uvloop.run(serving(hangs, on_hangs))
    uvloop.run(refused())


def test_callers_beyond_max_connections_wait_and_a_cancelled_caller_frees_its_connection() -> None:
    peak = live = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal peak, live
        live += 1
        peak = max(peak, live)
        try:
            while True:
                await read_request(reader)
                await asyncio.sleep(0.01)
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            live -= 1

    async def run(url: str) -> None:
        p = pool(url, max_connections=2)

        async def one() -> bytes:
            answer = await p.post("/x", {}, b"{}")
            try:
                return await answer.read()
            finally:
                answer.release()

        assert await asyncio.gather(*(one() for _ in range(20))) == [b"ok"] * 20
        assert peak == 2
        doomed = asyncio.create_task(one())
        await asyncio.sleep(0.003)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert await asyncio.gather(*(one() for _ in range(4))) == [b"ok"] * 4
        assert len(p.open) <= 2
        p.close()

    uvloop.run(serving(handler, run))


def test_vllm_server_takes_the_pool_for_http_and_aiohttp_for_https() -> None:
    assert VllmServerEngine("m", "http://127.0.0.1:8000/").pool is not None
    assert VllmServerEngine("m", "https://api.example.com").pool is None


def test_a_timed_out_request_is_not_sent_again_and_informational_answers_are_skipped() -> None:
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            requests.append(request.rsplit(b"\r\n\r\n", 1)[1])
            if request.endswith(b"slow"):
                await asyncio.sleep(1)  # past the read timeout: an engine still generating
                continue
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst")
            await writer.drain()

    async def run(url: str) -> None:
        p = pool(url, read_timeout_s=0.2)
        answer = await p.post("/x", {}, b"warm")
        assert (answer.status, await answer.read()) == (200, b"first")
        answer.release()
        answer.release()  # a second release changes nothing
        assert len(p.idle) == 1
        with pytest.raises(NetFailure) as err:
            await p.post("/x", {}, b"slow")  # on the reused connection
        assert err.value.kind == "timeout"
        await asyncio.sleep(0.1)
        assert requests == [b"warm", b"slow"]  # sent once: an engine call is not idempotent
        with pytest.raises(ValueError, match="line break"):
            await p.post("/x", {"x-a": "v\r\nX-Injected: 1"}, b"{}")
        p.close()
        with pytest.raises(NetFailure, match="closed"):
            await p.post("/x", {}, b"{}")

    uvloop.run(serving(handler, run))


def test_a_waiter_woken_then_cancelled_passes_the_connection_on_and_fresh_frees_an_idle_slot() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)
            await writer.drain()

    async def run(url: str) -> None:
        p = pool(url, max_connections=1)
        held = await p.post("/x", {}, b"{}")
        second = asyncio.create_task(p._connection())
        third = asyncio.create_task(p._connection())
        await asyncio.sleep(0.01)  # both wait for the one slot
        assert await held.read() == b"ok"
        held.release()  # wakes the second...
        second.cancel()  # ...which is cancelled before it runs: the third must get the connection
        answer, reused = await asyncio.wait_for(third, 1)
        assert reused and answer is held
        answer.busy = True  # as send() would
        answer.release()
        fresh, reused = await asyncio.wait_for(p._connection(fresh=True), 1)  # the idle one makes room
        assert not reused and fresh is not held and p.open == {fresh} and not p.idle
        p.close()

    uvloop.run(serving(handler, run))
