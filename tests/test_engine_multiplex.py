"""engine-proxy's Multiplex: many Generate / GenerateOnce calls on one stream, told apart by id, each
answered as its own call would be (chunks, end, or its error with code, reason and param); a cancel
stops one call, a deadline ends one call, the end of the caller's side lets open calls finish, and a
draining engine-proxy refuses new calls and ends the stream once open ones are answered. Driven with
a real engine-proxy and a scripted vllm-server (examlops_testsupport.scripted). The gateway's side
is tested in services/gateway/tests/test_multiplex.py."""

from __future__ import annotations

import functools
import queue
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as pb_grpc
from examlops.svc import blocking_channel, error_reason
from examlops_devstack import free_port, wait_grpc
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.scripted import DONE, EVENTS, WHOLE, Scripted, module_route, routed, stripped
from examlops_testsupport.workers import start_engine_proxy

MODEL = "scripted-mux"
request, scripted = module_route(MODEL)


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

    def first_event(self, call_id: int) -> None:
        """The next reply is call `call_id`'s first event (not its error)."""
        reply = self.next()
        assert reply is not None and reply.id == call_id and reply.chunk.sse == stripped(EVENTS[0]), reply

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
    mux.first_event(1)
    mux.send(2, request("whole", stream=False), once=True)  # answered while call 1 waits
    (whole,) = mux.until_end(2)
    assert whole.end and whole.chunk.final and whole.chunk.data == WHOLE and whole.chunk.replica == "r0"
    mux.send(3, request("ping"))
    streamed = mux.until_end(3)
    assert b"".join(r.chunk.sse for r in streamed) == b"".join(stripped(e) for e in EVENTS)
    assert [r.end for r in streamed] == [False] * (len(streamed) - 1) + [True]
    assert streamed[-1].chunk.final  # the final chunk's message ends the call
    go.set()
    rest = mux.until_end(1)
    assert b"".join(r.chunk.sse for r in rest) == b"".join(stripped(e) for e in EVENTS[1:])
    assert rest[-1].chunk.final and rest[-1].chunk.usage.completion_tokens == 7


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
    mux.first_event(1)
    mux.send(1, cancel=True)
    mux.send(2, request("slow"), timeout_ms=500)
    mux.first_event(2)
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
    mux.first_event(7)
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
    mux.first_event(1)
    mux.close()  # no more calls; call 1 is still open
    go.set()
    assert mux.until_end(1)[-1].end
    assert mux.next() is None  # then the stream ends, OK



# Draining: a stopping engine-proxy takes no new call on an open stream.

def test_a_draining_engine_proxy_refuses_new_calls_on_a_stream_and_ends_it_once_open_calls_are_answered(
        scripted: Scripted, stack: Stack) -> None:
    server, _ = scripted
    go = threading.Event()
    server.scripts["held"] = [EVENTS[0], go, b"".join(EVENTS[1:]) + DONE]
    port = free_port()
    proc = start_engine_proxy(stack, "ep-drain", port, free_port(), workers=1)
    try:
        wait_grpc(f"127.0.0.1:{port}", 30, proc)
        stub = pb_grpc.EngineProxyStub(blocking_channel(f"127.0.0.1:{port}", stack.tokens.operator_token))
        wait_until(functools.partial(routed, stub, MODEL), 10, what="the new engine-proxy routes the scripted server")
        mux = Mux(stub)
        mux.send(1, request("held"))
        mux.first_event(1)
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
        mux.close()
        assert proc.popen.wait(timeout=30) == 0
    finally:
        go.set()
        proc.stop()
