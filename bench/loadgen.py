"""Load generator of the gateway benchmark: a lean HTTP/1.1 keep-alive client on raw asyncio.

It runs in its own process so that its CPU is not the servers'. Each client is one keep-alive
connection sending one request at a time (no pipelining); latency is from the write of the request
to the last byte of the response (for a stream: the chunked terminator after `data: [DONE]`), and
for a stream the time to first token (TTFT) is from that write to the arrival of the first byte of
the first `data:` event.
The request bytes are built once, so the client costs the same few microseconds in front of any
server, which is what makes "direct" and "through the gateway" comparable.

Driven by bench_gateway.py over stdin/stdout, one JSON object a line:

    parent -> {"url": ..., "path": ..., "body": ..., "api_key": ..., "stream": bool,
               "concurrency": 32, "requests": 10000, "warmup": 500, "max_seconds": 25}
    child  -> {"event": "ready"}          connections open, warm-up done; CPU snapshot now
    parent -> "go"
    child  -> {"event": "done", "count": ..., "errors": ..., "elapsed_s": ..., "rps": ..., "p50_ms": ...,
               "ttft_p50_ms": ..., "ttft_p90_ms": ..., "ttft_p99_ms": ...}   (the ttft_* are null unless "stream")
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit


class ResponseError(Exception):
    pass


class Connection(asyncio.Protocol):
    """One keep-alive connection that parses Content-Length and chunked responses incrementally."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.first_event_ns = 0  # perf_counter_ns when the first `data:` of the current response arrived
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.body_start = -1     # offset of the body in buf once the head is parsed
        self.length = -1         # Content-Length, or -1 for chunked
        self.pos = 0             # chunked: offset of the next chunk-size line
        self.closes = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ResponseError(f"connection closed: {exc or 'by the server'}"))

    def send(self, request: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.first_event_ns = 0
        self.transport.write(request)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        if not self.first_event_ns and b"data:" in data:
            # a `data:` split across two reads is not seen here: the stub and the proxies under test
            # write whole events, and a missed one only delays the stamp to the next event's arrival
            self.first_event_ns = time.perf_counter_ns()
        self.buf += data
        try:
            done = self._parse()
        except (ValueError, ResponseError) as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(ResponseError(f"bad response: {exc}"))
            self.transport.close()
            return
        if done is not None and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(done)

    def _parse(self) -> tuple[int, bytes] | None:
        buf = self.buf
        if self.body_start < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            lines = bytes(buf[:end]).split(b"\r\n")
            self.status = int(lines[0].split(b" ", 2)[1])
            chunked = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self.length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and value.strip().lower() == b"close":
                    self.closes = True
            if not chunked and self.length < 0:
                raise ResponseError("response without Content-Length or chunked encoding")
            if chunked:
                self.length = -1
            self.body_start = self.pos = end + 4
        if self.length >= 0:
            total = self.body_start + self.length
            if len(buf) < total:
                return None
            return self._finish(bytes(buf[self.body_start:total]), total)
        while True:  # chunked
            eol = buf.find(b"\r\n", self.pos)
            if eol < 0:
                return None
            size = int(bytes(buf[self.pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                # last chunk; no trailers expected: the next two bytes end the message
                if len(buf) < eol + 4:
                    return None
                if buf[eol + 2:eol + 4] != b"\r\n":
                    raise ResponseError("trailers are not supported")
                return self._finish(bytes(buf[self.body_start:eol + 4]), eol + 4)
            if len(buf) < eol + 2 + size + 2:
                return None
            self.pos = eol + 2 + size + 2

    def _finish(self, body: bytes, consumed: int) -> tuple[int, bytes]:
        status = self.status
        if self.closes:
            self.transport.close()
        del self.buf[:consumed]
        self._reset()
        return status, body


def build_request(host: str, path: str, body: bytes, api_key: str, stream: bool) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {api_key}\r\n"
            f"Content-Type: application/json\r\nAccept: {'text/event-stream' if stream else 'application/json'}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def valid(status: int, body: bytes, stream: bool) -> bool:
    if status != 200:
        return False
    return b"data: [DONE]" in body if stream else b'"choices"' in body


class Runner:
    def __init__(self, spec: dict[str, Any]) -> None:
        url = urlsplit(spec["url"])
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or 80
        self.stream = bool(spec["stream"])
        self.request = build_request(f"{self.host}:{self.port}", spec["path"], spec["body"].encode(),
                                     spec["api_key"], self.stream)
        self.concurrency = int(spec["concurrency"])
        self.conns: list[Connection] = []
        self.errors = 0
        self.first_error = ""

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(Connection, self.host, self.port)
        return conn

    async def open(self) -> None:
        self.conns = [await self._connect() for _ in range(self.concurrency)]

    def close(self) -> None:
        for conn in self.conns:
            if not conn.closed:
                conn.transport.close()

    async def _client(self, i: int, quota: list[int], deadline: float, lat: list[int] | None,
                      ttft: list[int] | None) -> None:
        perf = time.perf_counter_ns
        request, stream = self.request, self.stream
        while quota[0] > 0 and time.monotonic() < deadline:
            quota[0] -= 1
            conn = self.conns[i]
            if conn.closed:
                conn = self.conns[i] = await self._connect()
            t0 = perf()
            try:
                status, body = await conn.send(request)
            except ResponseError as exc:
                self._error(str(exc))
                continue
            t1 = perf()
            if not valid(status, body, stream):
                self._error(f"HTTP {status}: {body[:300]!r}")
                continue
            if lat is not None:
                lat.append(t1 - t0)
            if ttft is not None:
                ttft.append((conn.first_event_ns or t1) - t0)

    def _error(self, what: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = what

    async def run(self, requests: int, max_seconds: float, record: bool) -> tuple[list[int], list[int], float]:
        """(latencies, TTFTs (streams only), elapsed seconds) of up to `requests` requests."""
        lat: list[int] | None = [] if record else None
        ttft: list[int] | None = [] if record and self.stream else None
        quota = [requests]
        deadline = time.monotonic() + max_seconds
        start = time.perf_counter()
        await asyncio.gather(*(self._client(i, quota, deadline, lat, ttft) for i in range(self.concurrency)))
        return lat or [], ttft or [], time.perf_counter() - start


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile in milliseconds."""
    if not sorted_ns:
        return float("nan")
    k = min(len(sorted_ns) - 1, max(0, round(q / 100 * len(sorted_ns) + 0.5) - 1))
    return sorted_ns[k] / 1e6


def summarize(lat: list[int], elapsed: float, errors: int, first_error: str,
              ttft: list[int] | None = None) -> dict[str, Any]:
    lat.sort()
    count = len(lat)
    if ttft:
        ttft.sort()
    ttft_ms = {f"ttft_p{q}_ms": percentile(ttft, q) if ttft else None for q in (50, 90, 99)}
    return {"event": "done", "count": count, "errors": errors, "first_error": first_error,
            "elapsed_s": elapsed, "rps": count / elapsed if elapsed > 0 else 0.0,
            "mean_ms": (sum(lat) / count / 1e6) if count else float("nan"),
            "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
            "max_ms": lat[-1] / 1e6 if lat else float("nan"), **ttft_ms}


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def phase(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    runner = Runner(spec)
    try:
        await runner.open()
        await runner.run(int(spec["warmup"]), float(spec["max_seconds"]), record=False)
        warm_errors, runner.errors = runner.errors, 0
        emit({"event": "ready", "warmup_errors": warm_errors, "first_error": runner.first_error})
        if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
            return
        lat, ttft, elapsed = await runner.run(int(spec["requests"]), float(spec["max_seconds"]), record=True)
        emit(summarize(lat, elapsed, runner.errors, runner.first_error, ttft))
    finally:
        runner.close()


async def serve(run_phase: Callable[[dict[str, Any]], Awaitable[None]] = phase) -> None:
    """Answer the parent's phases until "quit" (or its stdin closes); `run_phase` runs one spec
    (bench_routing's gRPC client brings its own)."""
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "quit":
            return
        try:
            await run_phase(json.loads(line))
        except (OSError, ValueError) as exc:
            emit({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})


def main() -> None:
    loop_factory = None
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve())


if __name__ == "__main__":
    main()
