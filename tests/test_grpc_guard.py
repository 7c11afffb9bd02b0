"""svc._guard: what build_grpc_server does around every call, on a real grpc.aio server in-process.

A handler added through register() is guarded once: an admitted caller is current_caller() in it,
a unary call is timed and counted with its code, a stream counted STARTED, a refused call ends with
its code and reason before the handler runs (and is counted), and a method nothing serves is
counted STARTED (as method `unknown`) and answered UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from prometheus_client import REGISTRY

from examlops.svc import OPERATORS, Access, ServerAuth, build_grpc_server, current_caller

TOKEN = "t" * 40
SERVICE = "test.Guarded"


async def hello(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request + b" " + current_caller().name.encode()


async def count(request: bytes, context: grpc.aio.ServicerContext) -> Any:
    for i in range(3):
        yield b"%d" % i


def register(server: grpc.aio.Server) -> None:
    handlers = {"Hello": grpc.unary_unary_rpc_method_handler(hello),
                "Count": grpc.unary_stream_rpc_method_handler(count)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def handled(method: str, code: str) -> float:
    return REGISTRY.get_sample_value("examlops_grpc_server_handled_total",
                                     {"method": method, "code": code}) or 0.0


async def scenario() -> None:
    auth = ServerAuth("guard-test", {"gateway": TOKEN}, Access({OPERATORS: None, "gateway": None}))
    server, port, _ = build_grpc_server("127.0.0.1", 0, register, [SERVICE], auth)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            meta = (("authorization", f"Bearer {TOKEN}"),)
            hello_call = channel.unary_unary(f"/{SERVICE}/Hello")
            ok, err = handled(f"/{SERVICE}/Hello", "OK"), handled(f"/{SERVICE}/Hello", "ERROR")
            assert await hello_call(b"hi", metadata=meta) == b"hi gateway"
            assert handled(f"/{SERVICE}/Hello", "OK") == ok + 1

            try:
                await hello_call(b"hi")
                raise AssertionError("answered without a token")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "carries no bearer token" in (exc.details() or "")
                assert ("examlops-reason", "unauthenticated") in tuple(exc.trailing_metadata() or ())
            assert handled(f"/{SERVICE}/Hello", "ERROR") == err + 1

            started = handled(f"/{SERVICE}/Count", "STARTED")
            got = [m async for m in channel.unary_stream(f"/{SERVICE}/Count")(b"", metadata=meta)]
            assert got == [b"0", b"1", b"2"]
            assert handled(f"/{SERVICE}/Count", "STARTED") == started + 1

            unknown = f"/{SERVICE}/Nothing"
            before = handled("unknown", "STARTED")
            try:
                await channel.unary_unary(unknown)(b"", metadata=meta)
                raise AssertionError("an unknown method answered")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
            # one series for every unknown name: a caller cannot grow /metrics by inventing methods
            assert handled("unknown", "STARTED") == before + 1 and handled(unknown, "STARTED") == 0
    finally:
        await server.stop(None)


def test_guarded_handlers_authenticate_count_and_refuse() -> None:
    asyncio.run(scenario())
