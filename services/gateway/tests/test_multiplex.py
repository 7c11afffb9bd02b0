"""The gateway's side of engine-proxy's Multiplex (examlops_gateway._multiplex), against a real
engine-proxy and a scripted vllm-server: a new stream every ROTATE_S with the old one closed once its
calls are answered, cancel and deadline, an engine-proxy that is down, and a call a draining worker
refuses sent again on a new stream, which another worker answers."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
from collections.abc import AsyncIterator

import grpc
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.svc import blocking_channel, error_reason, insecure_channel
from examlops_devstack import free_port, wait_grpc
from examlops_gateway import _multiplex as multiplex
from examlops_gateway._multiplex import EngineMultiplex, MultiplexCall
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.scripted import DONE, EVENTS, WHOLE, Scripted, module_route, routed, stripped
from examlops_testsupport.workers import children, holding_connection, start_engine_proxy

MODEL = "scripted-gateway-mux"
request, scripted = module_route(MODEL)


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




def test_a_gateway_call_a_draining_worker_refuses_is_sent_again_and_answered_by_another(
        scripted: Scripted, stack: Stack) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    port = free_port()
    proc = start_engine_proxy(stack, "ep-drain-workers", port, free_port(), workers=2)
    addr = f"127.0.0.1:{port}"

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
        wait_grpc(addr, 30, proc)
        wait_until(lambda: "2 workers serving" in proc.log_tail(), 30, what="both workers serving")
        for _ in range(4):  # each worker follows the registry on its own: a few calls reach both
            with blocking_channel(addr, stack.tokens.operator_token) as checking:  # closed: one connection left
                stub = pb_grpc.EngineProxyStub(checking)
                wait_until(functools.partial(routed, stub, MODEL), 10, what="the workers route the scripted server")
        asyncio.run(run())
    finally:
        go.set()
        proc.stop()
