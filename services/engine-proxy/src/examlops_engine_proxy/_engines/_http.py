"""A lean HTTP/1.1 client for the engine calls on the request path (POST to an `http://` server).

aiohttp costs ~121 µs of engine-proxy's CPU per streamed request to the benchmark's stub (request
object, header multidicts, connector bookkeeping, stream reader); writing the request bytes on a
kept-alive socket and reading the answer with httptools' C parser costs ~30 µs. `HttpPool` is that,
per replica: up to `max_connections` kept-alive connections (more callers wait for one), the answer
exposed as aiohttp's is to its one user (`status`, `read()`, `content.iter_any()`,
`content.at_eof()`, `release()`), failures as `NetFailure(kind, detail)` with the kinds failover
understands (`connect`: nothing answers there; `timeout`; `read`).

What it does not do, and what it does instead:
- no TLS, proxies or redirects: an `https://` engine keeps aiohttp (vllm-server chooses);
- a kept-alive connection the server closed while idle (uvicorn closes them after 5 s) is never
  reused once seen closed, nor after IDLE_S of rest; a request whose reused connection is lost
  within UNREAD_S of the write, before any byte of answer, is sent once more on a new one (the
  server had closed it idle and never read the request); never after a timeout or a byte of answer;
- an answer must carry Content-Length or be chunked (vLLM's always do); one that ends the
  connection instead is read as `server disconnected` if it stops early. Informational answers
  (1xx) are skipped; bytes on a connection nobody asked anything of end it; a path or header with a
  line break or NUL is refused (ValueError) before anything is sent.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

#: A kept-alive connection idle longer than this is closed rather than reused (below uvicorn's 5 s).
IDLE_S = 4.0
#: A reused connection lost this soon after the request was written, before any byte of answer, was
#: closed by the server while idle: the request is sent once more on a new connection. Never after a
#: timeout or an answer's first byte: an engine call is no idempotent request.
UNREAD_S = 0.05
#: Characters a request line or header must not carry (they would start a line of their own).
_BREAKS = ("\r", "\n", "\0")


class NetFailure(Exception):
    """A network failure, classified: `kind` is connect, timeout or read."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class _Answer(asyncio.Protocol):
    """One connection, and the answer it is reading (aiohttp's response and content, in one)."""

    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.pieces: list[bytes] = []
        self.headers_done = self.complete = self.got_bytes = self.keep_alive = False
        self.busy = False  # between send() and release()
        self.sent_at = 0.0
        self.failure: NetFailure | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0

    # -- the connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing was asked on this connection: it cannot be trusted again
            self._fail(NetFailure("read", "the server sent bytes nobody asked for"))
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(NetFailure("read", f"the server's answer is not HTTP/1.1: {exc}"))
            return
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.complete:
            self._fail(NetFailure("read", "server disconnected"))
        self.pool.forget(self)

    # -- httptools' callbacks
    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() < 200:  # 100 Continue, 103 Early Hints: the answer follows
            return
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # asked here: past the answer's end it reads False
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        if self.headers_done:  # not the end of an informational (1xx) answer
            self.complete = True

    # -- waiting
    def _fail(self, failure: NetFailure) -> None:
        if self.failure is None:
            self.failure = failure
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _timed_out(self) -> None:
        if self.waiter is not None and not self.waiter.done():  # not when bytes came in the same loop turn
            self._fail(NetFailure("timeout", "timed out waiting for the server"))

    async def _wait(self) -> None:
        """Until something new: bytes, the answer's end or a failure (NetFailure raises)."""
        if self.failure is not None:
            raise self.failure
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.timer = loop.call_later(self.pool.read_timeout_s, self._timed_out)
        try:
            await self.waiter
        finally:
            self.timer.cancel()
            self.waiter = None
        if self.failure is not None:
            raise self.failure

    # -- one exchange
    def send(self, request: bytes) -> None:
        self.status, self.headers_done, self.complete, self.got_bytes = 0, False, False, False
        self.pieces.clear()
        self.busy, self.sent_at = True, time.monotonic()
        assert self.transport is not None
        self.transport.write(request)

    def unread(self) -> bool:
        """The request met a connection the server had closed: lost at once, before any answer byte.
        (A server reads a request and answers it, or closes an idle connection; not both.)"""
        return (self.failure is not None and self.failure.kind == "read" and not self.got_bytes
                and time.monotonic() - self.sent_at < UNREAD_S)

    async def head(self) -> None:
        while not self.headers_done:
            await self._wait()

    # -- aiohttp's face
    @property
    def content(self) -> _Answer:
        return self

    async def read(self) -> bytes:
        while not self.complete:
            await self._wait()
        body = b"".join(self.pieces)
        self.pieces.clear()
        return body

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            if self.pieces:
                data = b"".join(self.pieces)
                self.pieces.clear()
                yield data
                continue
            if self.complete:
                return
            await self._wait()

    def at_eof(self) -> bool:
        return self.complete and not self.pieces

    def release(self) -> None:
        """Back to the pool when the answer was read whole on a connection the server keeps open
        (once: a second call does nothing)."""
        if self.busy:
            self.busy = False
            self.pool.give_back(self, reusable=self.complete and self.failure is None and self.keep_alive)


class HttpPool:
    """Kept-alive connections to one `http://host:port[/prefix]` server."""

    def __init__(self, base_url: str, *, connect_timeout_s: float, read_timeout_s: float,
                 max_connections: int, headers: dict[str, str] | None = None) -> None:
        """`headers`: sent with every request, encoded and checked once here (one that cannot be
        sent fails each request, as a bad per-request header does)."""
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.username is not None:
            raise ValueError(f"HttpPool speaks plain http://host:port (no credentials in the URL), "
                             f"not {parts.scheme}://")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.refused: ValueError | None = None
        try:
            lines = _header_lines(headers or {})
        except ValueError as exc:
            lines, self.refused = b"", exc
        self.head = b"\r\nHost: " + parts.netloc.encode() + b"\r\n" + lines
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.max_connections = max_connections
        self.idle: list[_Answer] = []
        self.open: set[_Answer] = set()
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closed = False

    def request_bytes(self, path: str, headers: dict[str, str], body: bytes) -> bytes:
        if self.refused is not None:
            raise self.refused
        if any(c in path for c in _BREAKS):
            raise ValueError("a line break or NUL in a request's path: not sent")
        return b"".join((f"POST {self.prefix}{path} HTTP/1.1".encode(), self.head, _header_lines(headers),
                         f"Content-Length: {len(body)}\r\n\r\n".encode(), body))

    async def post(self, path: str, headers: dict[str, str], body: bytes) -> _Answer:
        """The answer once its status and headers are in; its body is read from it, then `release()`.
        `headers`: this request's own, beside the pool's."""
        request = self.request_bytes(path, headers, body)
        for attempt in (0, 1):
            answer, reused = await self._connection(fresh=attempt > 0)
            try:
                answer.send(request)
                await answer.head()
                return answer
            except NetFailure:
                answer.release()  # closes it
                if attempt or not reused or not answer.unread():
                    raise
            except BaseException:  # cancelled: the connection goes, the answer half-read
                answer.release()
                raise
        raise AssertionError("unreachable")

    async def _connection(self, fresh: bool = False) -> tuple[_Answer, bool]:
        """(a connection, whether it was reused): an idle one unless `fresh`, else a new one once
        fewer than max_connections are open."""
        while True:
            if self.closed:
                raise NetFailure("connect", "the engine's client is closed")
            now = time.monotonic()
            while self.idle and not fresh:
                answer = self.idle.pop()
                if (answer.transport is not None and not answer.transport.is_closing()
                        and now - answer.idle_since < IDLE_S):
                    return answer, True
                self._close(answer)
            if len(self.open) < self.max_connections:
                return await self._connect(), False
            if self.idle:  # a fresh one is wanted and idle connections hold the slots: one goes
                self._close(self.idle.pop(0))
                continue
            waiter = asyncio.get_running_loop().create_future()
            self.waiting.append(waiter)
            try:
                await waiter  # a connection was closed or given back
            except BaseException:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled: wake the next
                    self._next()
                raise

    async def _connect(self) -> _Answer:
        loop = asyncio.get_running_loop()
        answer = _Answer(self)
        self.open.add(answer)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: answer, self.host, self.port)
        except TimeoutError:
            self.forget(answer)
            raise NetFailure("connect", "connect timed out") from None
        except ConnectionRefusedError:
            self.forget(answer)
            raise NetFailure("connect", "connection refused") from None
        except OSError as exc:
            self.forget(answer)
            raise NetFailure("connect", f"cannot connect ({exc.strerror or type(exc).__name__})") from None
        except BaseException:
            self.forget(answer)
            raise
        return answer

    def give_back(self, answer: _Answer, reusable: bool) -> None:
        if reusable and answer in self.open and not self.closed:
            answer.idle_since = time.monotonic()
            self.idle.append(answer)
            self._next()
        else:
            self._close(answer)

    def _close(self, answer: _Answer) -> None:
        if answer.transport is not None:
            answer.transport.abort()
        self.forget(answer)

    def forget(self, answer: _Answer) -> None:
        if answer in self.idle:
            self.idle.remove(answer)
        if answer in self.open:
            self.open.discard(answer)
            self._next()

    def _next(self) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        self.closed = True
        for answer in list(self.open):
            self._close(answer)


def _header_lines(headers: dict[str, str]) -> bytes:
    """`name: value` lines; ValueError naming the header (never its value: it may be a key) when
    one holds a line break or NUL, which would start a header of its own."""
    for name, value in headers.items():
        if any(c in name or c in value for c in _BREAKS):
            raise ValueError(f"the request header {name.splitlines()[0][:40]!r} holds a line break or NUL: not sent")
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
