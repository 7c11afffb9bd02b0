"""engine-proxy's Multiplex: many Generate / GenerateOnce calls on one stream, told apart by id, each
answered as its own call would be (chunks, end, or its error with code, reason and param); a cancel
stops one call, a deadline ends one call, the end of the caller's side lets open calls finish.
Driven with a real engine-proxy and the scripted vllm-server of test_engine_stream_messages."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.svc import blocking_channel, error_reason, insecure_channel
from examlops_devstack import Proc, free_port, service_argv, spawn, wait_grpc
from examlops_gateway import _multiplex as multiplex
from examlops_gateway._multiplex import EngineMultiplex, MultiplexCall
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.scripted import DONE, EVENTS, WHOLE, ScriptedServer, stripped
from examlops_testsupport.workers import children, holding_connection

MODEL = "scripted-mux"
Scripted = tuple[ScriptedServer, pb_grpc.EngineProxyStub]


def request(script: str, stream: bool = True) -> pb.GenerateRequest:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": script}], "stream": stream}
    return pb.GenerateRequest(endpoint=MODEL, kind=pb.REQUEST_KIND_CHAT, body_json=json.dumps(body).encode())


def _routed(stub: pb_grpc.EngineProxyStub) -> bool:
    try:
        stub.GenerateOnce(request("whole", stream=False), timeout=10)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
            return False
        raise
    return True


@pytest.fixture(scope="module")
def scripted(stack: Stack) -> Iterator[Scripted]:
    server = ScriptedServer()
    server.scripts["ping"] = [b"".join(EVENTS) + DONE]
    stack.register(MODEL, engine="vllm-server", base_url=server.url,
                   engine_block_json=json.dumps({"engine": "vllm", "hf_model_id": "org/m"}))
    stub = pb_grpc.EngineProxyStub(stack.channel("engine-proxy"))
    wait_until(lambda: _routed(stub), 10, what="engine-proxy routes the scripted server")
    try:
        yield server, stub
    finally:
        server.close()


class Mux:
    """One Multiplex stream: `send` writes a message, `next` reads a reply (30 s at most)."""

    def __init__(self, stub: pb_grpc.EngineProxyStub) -> None:
        self.outbox: queue.Queue[pb.MultiplexRequest | None] = queue.Queue()
        self.replies = stub.Multiplex(iter(self.outbox.get, None), timeout=60)
        self.inbox: queue.Queue[pb.MultiplexReply | grpc.RpcError | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.replies:
                self.inbox.put(reply)
            self.inbox.put(None)
        except grpc.RpcError as exc:
            self.inbox.put(exc)

    def send(self, call_id: int, req: pb.GenerateRequest | None = None, *, once: bool = False,
             timeout_ms: int = 30_000, cancel: bool = False) -> None:
        self.outbox.put(pb.MultiplexRequest(id=call_id, request=req, once=once, timeout_ms=timeout_ms, cancel=cancel))

    def next(self) -> pb.MultiplexReply | None:
        reply = self.inbox.get(timeout=30)
        assert not isinstance(reply, grpc.RpcError), reply
        return reply

    def until_end(self, call_id: int) -> list[pb.MultiplexReply]:
        got = []
        while True:
            reply = self.next()
            assert reply is not None and reply.id == call_id, reply
            got.append(reply)
            if reply.end or reply.HasField("error"):
                return got

    def close(self) -> None:
        self.outbox.put(None)


@pytest.fixture
def mux(scripted: Scripted) -> Iterator[Mux]:
    s = Mux(scripted[1])
    try:
        yield s
    finally:
        s.close()
        s.replies.cancel()


def test_calls_interleave_on_one_stream_and_each_gets_its_own_answer(scripted: Scripted, mux: Mux) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    mux.send(1, request("held"))
    first = mux.next()
    assert first is not None and first.id == 1 and first.chunk.sse == stripped(EVENTS[0])
    mux.send(2, request("whole", stream=False), once=True)  # answered while call 1 waits
    (whole,) = mux.until_end(2)
    assert whole.end and whole.chunk.final and whole.chunk.data == WHOLE and whole.chunk.replica == "r0"
    mux.send(3, request("ping"))
    streamed = mux.until_end(3)
    assert b"".join(r.chunk.sse for r in streamed) == b"".join(stripped(e) for e in EVENTS)
    assert streamed[-1].end and not streamed[-1].HasField("chunk") and streamed[-2].chunk.final
    go.set()
    rest = mux.until_end(1)
    assert b"".join(r.chunk.sse for r in rest) == b"".join(stripped(e) for e in EVENTS[1:])
    assert rest[-2].chunk.usage.completion_tokens == 7


def test_a_call_s_error_is_the_status_its_own_call_would_end_with(scripted: Scripted, mux: Mux) -> None:
    _, stub = scripted
    missing = pb.GenerateRequest(endpoint="no-such-route", kind=pb.REQUEST_KIND_CHAT, body_json=b"{}")
    with pytest.raises(grpc.RpcError) as direct:
        stub.GenerateOnce(missing, timeout=10)
    mux.send(1, missing, once=True)
    (reply,) = mux.until_end(1)
    assert reply.error.code == direct.value.code().value[0] == grpc.StatusCode.NOT_FOUND.value[0]  # type: ignore[attr-defined]
    assert (reply.error.reason, reply.error.param) == error_reason(direct.value)  # type: ignore[arg-type]
    assert reply.error.message == direct.value.details()  # type: ignore[attr-defined]
    mux.send(2, request("whole"), once=True)  # GenerateOnce refuses a stream, here too
    (refused,) = mux.until_end(2)
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and refused.error.param == "stream"
    mux.send(3, request("ping"))  # the stream goes on
    assert mux.until_end(3)[-1].end


def test_a_cancel_ends_one_call_and_a_deadline_another(scripted: Scripted, mux: Mux) -> None:
    server, _ = scripted
    never, later = threading.Event(), threading.Event()
    server.scripts["stuck"] = [EVENTS[0], never, DONE]
    server.scripts["slow"] = [EVENTS[0], later, DONE]
    mux.send(1, request("stuck"))
    assert mux.next().id == 1  # type: ignore[union-attr]
    mux.send(1, cancel=True)
    mux.send(2, request("slow"), timeout_ms=500)
    assert mux.next().id == 2  # type: ignore[union-attr]
    (expired,) = mux.until_end(2)  # call 1 says nothing more: the next reply is call 2's end
    assert expired.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    mux.send(3, request("ping"))
    assert mux.until_end(3)[-1].end
    never.set()
    later.set()


def test_a_reused_id_is_refused_and_the_open_call_goes_on(scripted: Scripted, mux: Mux) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    mux.send(7, request("held"))
    assert mux.next().id == 7  # type: ignore[union-attr]
    mux.send(7, request("ping"))
    refused = mux.next()
    assert refused is not None and refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    go.set()
    assert mux.until_end(7)[-1].end


def test_closing_the_caller_s_side_lets_open_calls_finish(scripted: Scripted, stack: Stack) -> None:
    server, stub = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    mux = Mux(stub)
    mux.send(1, request("held"))
    assert mux.next().id == 1  # type: ignore[union-attr]
    mux.close()  # no more calls; call 1 is still open
    go.set()
    assert mux.until_end(1)[-1].end
    assert mux.next() is None  # then the stream ends, OK


# The gateway's side (examlops_gateway._multiplex), on the same real engine-proxy.

def _gateway_mux(stack: Stack) -> tuple[grpc.aio.Channel, EngineMultiplex]:
    channel = insecure_channel(stack.ports.addr("engine-proxy"), stack.tokens.operator_token)
    return channel, EngineMultiplex(channel)


def test_the_gateway_opens_a_new_stream_after_rotate_s_and_closes_the_old_one_once_answered(
        scripted: Scripted, stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]

    async def run() -> None:
        channel, mux = _gateway_mux(stack)
        held = mux.call(request("held"), once=False, timeout=30)
        assert (await held.read()).sse == stripped(EVENTS[0])
        first = mux.current
        monkeypatch.setattr(multiplex, "ROTATE_S", 0.0)
        for _ in range(3):  # each call on a new stream; the old ones close as their calls end
            answer = await mux.call(request("whole", stream=False), once=True, timeout=30)
            assert answer.data == WHOLE
        assert mux.current is not first and first in mux.streams  # first still has `held`
        go.set()
        rest = [chunk async for chunk in _chunks(held)]
        assert b"".join(c.sse for c in rest) == b"".join(stripped(e) for e in EVENTS[1:]) and rest[-1].final
        for _ in range(500):  # engine-proxy ends each retired stream once we closed our side
            if mux.streams == {mux.current}:
                break
            await asyncio.sleep(0.01)
        assert mux.streams == {mux.current}
        mux.close()
        await channel.close()

    asyncio.run(run())


def test_a_gateway_call_cancelled_or_past_its_deadline_ends_and_the_session_goes_on(
        scripted: Scripted, stack: Stack) -> None:
    server, _ = scripted
    never = threading.Event()
    server.scripts["stuck"] = [EVENTS[0], never, DONE]

    async def run() -> None:
        channel, mux = _gateway_mux(stack)
        stuck = mux.call(request("stuck"), once=False, timeout=30)
        assert (await stuck.read()).sse == stripped(EVENTS[0])
        assert stuck.cancel() and not stuck.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as cancelled:
            await stuck.read()
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        late = mux.call(request("stuck"), once=False, timeout=0.5)
        await late.read()
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await late.read()
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        missing = pb.GenerateRequest(endpoint="no-such-route", kind=pb.REQUEST_KIND_CHAT, body_json=b"{}")
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await mux.call(missing, once=True, timeout=30)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and error_reason(unknown.value)[1] == "model"
        assert (await mux.call(request("whole", stream=False), once=True, timeout=30)).data == WHOLE
        assert len(mux.streams) == 1
        mux.close()
        await channel.close()

    asyncio.run(run())
    never.set()


def test_a_gateway_call_to_an_engine_proxy_that_is_down_fails_unavailable_and_the_next_opens_a_new_stream() -> None:
    async def run() -> None:
        channel = insecure_channel(f"127.0.0.1:{free_port()}", "token")
        mux = EngineMultiplex(channel)
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await mux.call(request("whole", stream=False), once=True, timeout=5)
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        mux.close()
        await channel.close()

    asyncio.run(run())


async def _chunks(call: MultiplexCall) -> AsyncIterator[pb.GenerateChunk]:
    while (chunk := await call.read()) is not grpc.aio.EOF:
        yield chunk


# Draining: a stopping engine-proxy (or one of its workers) takes no new call on an open stream.

def _start_engine_proxy(stack: Stack, name: str, workers: int = 1) -> tuple[Proc, str]:
    port = free_port()
    env = {**stack.env("engine-proxy"), "EXAMLOPS_PORT": str(port), "EXAMLOPS_METRICS_PORT": str(free_port()),
           "EXAMLOPS_WORKERS": str(workers)}
    proc = spawn(name, service_argv("engine-proxy"), env, stack.workdir / f"{name}.log")
    wait_grpc(f"127.0.0.1:{port}", 30, proc)
    return proc, f"127.0.0.1:{port}"


def test_a_draining_engine_proxy_refuses_new_calls_on_a_stream_and_ends_it_once_open_calls_are_answered(
        scripted: Scripted, stack: Stack) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    proc, addr = _start_engine_proxy(stack, "ep-drain")
    try:
        stub = pb_grpc.EngineProxyStub(blocking_channel(addr, stack.tokens.operator_token))
        wait_until(lambda: _routed(stub), 10, what="the new engine-proxy routes the scripted server")
        mux = Mux(stub)
        mux.send(1, request("held"))
        assert mux.next().id == 1  # type: ignore[union-attr]
        proc.popen.send_signal(signal.SIGTERM)
        wait_until(lambda: "shutting down" in proc.log_tail(), 10, what="engine-proxy shutting down")
        time.sleep(0.3)  # it drains right after that line
        mux.send(2, request("ping"))
        refused = mux.next()
        assert refused is not None and refused.id == 2
        assert (refused.error.code, refused.error.reason) == (grpc.StatusCode.UNAVAILABLE.value[0], "draining")
        go.set()
        assert mux.until_end(1)[-1].end  # the open call is answered whole
        assert mux.next() is None  # then the stream ends, OK
        assert proc.popen.wait(timeout=30) == 0
    finally:
        go.set()
        proc.stop()


def test_a_gateway_call_a_draining_worker_refuses_is_sent_again_and_answered_by_another(
        scripted: Scripted, stack: Stack) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    proc, addr = _start_engine_proxy(stack, "ep-drain-workers", workers=2)
    port = int(addr.rsplit(":", 1)[1])

    async def run() -> None:
        channel = insecure_channel(addr, stack.tokens.operator_token)
        mux = EngineMultiplex(channel)
        held = mux.call(request("held"), once=False, timeout=30)
        assert (await held.read()).sse == stripped(EVENTS[0])
        (worker,) = holding_connection(children(proc.pid), port)  # the worker our stream is on
        os.kill(worker, signal.SIGTERM)
        await asyncio.sleep(0.5)  # it drains: new calls on our stream are refused
        answer = await mux.call(request("whole", stream=False), once=True, timeout=30)
        assert answer.data == WHOLE  # sent again on a new stream, which the other worker took
        assert holding_connection(children(proc.pid), port) - {worker}
        go.set()
        rest = [chunk async for chunk in _chunks(held)]
        assert rest[-1].final  # the draining worker answered its open call whole
        mux.close()
        await channel.close()

    try:
        wait_until(lambda: "2 workers serving" in proc.log_tail(), 30, what="both workers serving")
        for _ in range(4):  # each worker follows the registry on its own: a few calls reach both
            with blocking_channel(addr, stack.tokens.operator_token) as checking:  # closed: one connection left
                stub = pb_grpc.EngineProxyStub(checking)
                wait_until(functools.partial(_routed, stub), 10, what="the workers route the scripted server")
        asyncio.run(run())
    finally:
        go.set()
        proc.stop()
