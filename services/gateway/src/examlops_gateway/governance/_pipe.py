"""The governance scripts over one pipelined Redis connection, for the calls on every request's path.

reserve.lua before the engine call and settle.lua after it are two Redis round trips per governed
request. Through redis-py each costs ~66 µs of the gateway's CPU (the command layer, the pool's lock,
the stream reader); the same EVALSHA written straight onto a socket and read with hiredis costs
~14 µs (measured on one core, uvloop). `ScriptPipe` is that: one connection per process, every
call's command written as it comes (the commands of one loop turn go out in one write), the replies
read back in order by hiredis and handed to their callers.

It keeps what the redis-py client gave these calls:
- replies decoded the same way (`decode_responses`: str, int, nested lists); an error reply raises
  redis.ResponseError; a script Redis lost (a restart, SCRIPT FLUSH) is sent again whole (EVAL);
- a lost connection fails the calls it carried with redis.ConnectionError and each is tried again on
  a new connection, up to `retries` times with the pool's backoff (20 ms doubling, at most 0.5 s):
  the gateway's client retries ConnectionError the same way, and the scripts were written for it
  (settle.lua answers "duplicate" to a repeat);
- a Redis that stops answering: a call waits `timeout_s` (and up to a quarter of it more, the
  watchdog's period), then the connection is dropped and its calls fail with redis.TimeoutError
  (GovernanceUnavailable for an admission; a settle is retried in the background, _governor.py);
- a wrong password is not tried again (AuthenticationError).
It speaks to one Redis over TCP or a unix socket, with the URL's user, password and database.
A Redis Cluster URL or TLS (rediss://) keeps redis-py's client (`scripts_for` decides).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
import redis.asyncio as redis
from redis import exceptions as rx
from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.backoff import ExponentialBackoff

from examlops.svc import is_cluster_url

from ._scripts import load_script, script_source

Args = Sequence[str | int | float]
#: The retry policy of the gateway's Redis calls, the client's (_app.gateway_redis) and the pipe's.
REDIS_RETRIES = 3
REDIS_BACKOFF = ExponentialBackoff(cap=0.5, base=0.02)


class _Connection(asyncio.Protocol):
    """One socket: commands out in order, replies back in order to their futures."""

    def __init__(self, on_lost: Callable[[_Connection], None]) -> None:
        self.reader = hiredis.Reader(encoding="utf-8", replyError=rx.ResponseError)
        self.waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.out: list[bytes] = []
        self.lost: Exception | None = None
        self.on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass

    def send(self, command: bytes) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise self.lost
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((future, time.monotonic()))
        if not self.out:
            loop.call_soon(self._flush)
        self.out.append(command)
        return future

    def _flush(self) -> None:
        if self.transport is not None and self.out and self.lost is None:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if not self.waiting:  # a reply nothing asked for: the stream is out of step
                self.abort(rx.ConnectionError("Redis sent a reply no command was waiting for"))
                return
            future, _ = self.waiting.popleft()
            if future.done():  # its caller gave up (cancelled); the reply still keeps the order
                continue
            if isinstance(reply, rx.ResponseError):
                # a Redis still loading its data after a restart: a ConnectionError, tried again (as redis-py)
                future.set_exception(rx.BusyLoadingError(str(reply)) if str(reply).startswith("LOADING") else reply)
            else:
                future.set_result(reply)

    def abort(self, exc: Exception) -> None:
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(rx.ConnectionError(f"Redis closed the connection{f': {exc}' if exc else ''}"))

    def _fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
            self.on_lost(self)
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)

    def oldest(self) -> float | None:
        return self.waiting[0][1] if self.waiting else None


class ScriptPipe:
    """EVALSHA of the governance scripts over one pipelined connection to the Redis of `url`."""

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = REDIS_RETRIES) -> None:
        options = parse_url(url)
        self.path: str | None = options.get("path") if options.get("connection_class") is UnixDomainSocketConnection \
            else None
        self.host, self.port = str(options.get("host", "localhost")), int(options.get("port", 6379))
        self.handshake = _handshake(dict(options))
        self.timeout_s, self.retries = timeout_s, retries
        self.conn: _Connection | None = None
        self.connecting: asyncio.Task[_Connection] | None = None
        self.watch: asyncio.Task[None] | None = None
        self.closed = False

    def script(self, name: str) -> PipedScript:
        return PipedScript(self, script_source(name))

    async def _connection(self) -> _Connection:
        if self.conn is not None and self.conn.lost is None:
            return self.conn
        if self.closed:
            raise rx.ConnectionError("the gateway is shutting down")
        if self.connecting is None or self.connecting.done():  # one connect at a time, shared by its callers
            self.connecting = asyncio.create_task(self._connect())
        task = self.connecting
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):  # close() stopped the connect
                raise rx.ConnectionError("the gateway is shutting down") from None
            raise

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()

        def lost(conn: _Connection) -> None:
            if self.conn is conn:
                self.conn = None

        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.path is not None:
                    _, conn = await loop.create_unix_connection(lambda: _Connection(lost), self.path)
                else:
                    _, conn = await loop.create_connection(lambda: _Connection(lost), self.host, self.port)
                for command in self.handshake:  # AUTH, SELECT
                    await conn.send(command)
        except BaseException as exc:
            if conn is not None:  # a handshake that failed, timed out or was cancelled: its socket goes
                conn.abort(rx.ConnectionError("the connection's handshake failed"))
            if isinstance(exc, rx.ResponseError):
                raise rx.AuthenticationError(f"Redis at {self._where()} refused the URL's credentials or "
                                             f"database: {exc}") from None
            if isinstance(exc, (OSError, TimeoutError)):  # TimeoutError: asyncio.timeout's
                raise rx.ConnectionError(f"cannot reach Redis at {self._where()}: "
                                         f"{exc or f'no answer within {self.timeout_s:g} s'}") from None
            raise  # a ConnectionError (LOADING: tried again), a cancellation
        self.conn = conn
        if self.watch is None or self.watch.done():
            self.watch = asyncio.create_task(self._watch())
        return conn

    def _where(self) -> str:
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    async def _watch(self) -> None:
        """Drop a connection whose oldest call waited past `timeout_s` (its Redis hangs)."""
        while not self.closed:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            conn = self.conn
            oldest = conn.oldest() if conn is not None else None
            if conn is not None and oldest is not None and time.monotonic() - oldest > self.timeout_s:
                conn.abort(rx.TimeoutError(f"Redis at {self._where()} did not answer within {self.timeout_s:g} s"))

    async def evalsha(self, sha: str, source: str, keys: Sequence[str], args: Args) -> Any:
        """The script's reply; sent again whole when Redis lost it (NOSCRIPT), and again on a new
        connection when one is lost (up to `retries` times)."""
        tail = (len(keys), *keys, *args)
        failures = 0
        while True:
            try:
                conn = await self._connection()
                try:
                    return await conn.send(_packed("EVALSHA", sha, *tail))
                except rx.ResponseError as exc:
                    if not str(exc).startswith("NOSCRIPT"):
                        raise
                return await conn.send(_packed("EVAL", source, *tail))
            except rx.AuthenticationError:
                raise  # the URL's credentials: trying again changes nothing
            except rx.ConnectionError:
                failures += 1
                if failures > self.retries:
                    raise
                await asyncio.sleep(REDIS_BACKOFF.compute(failures))

    async def close(self) -> None:
        self.closed = True
        for task in (self.watch, self.connecting):
            if task is not None:
                task.cancel()
        if self.conn is not None:
            self.conn.abort(rx.ConnectionError("the gateway is shutting down"))
            self.conn = None


class PipedScript:
    """A script called as redis-py's AsyncScript is: `await script(keys=[...], args=[...])`."""

    def __init__(self, pipe: ScriptPipe, source: str) -> None:
        self.pipe, self.source = pipe, source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[str] = (), args: Args = ()) -> Any:
        return await self.pipe.evalsha(self.sha, self.source, keys, [_encoded(a) for a in args])


def _encoded(value: str | int | float) -> str:
    """An argument as redis-py's encoder writes it (a bool is refused, as there)."""
    if isinstance(value, bool):
        raise rx.DataError(f"a bool is no Redis argument ({value!r}): send it as 0 or 1")
    return value if isinstance(value, str) else repr(value)


def _packed(*command: str | int | float) -> bytes:
    packed: bytes = hiredis.pack_command(command)  # type: ignore[arg-type]  # its stub types a 1-tuple
    return packed


def _handshake(options: dict[str, Any]) -> list[bytes]:
    """AUTH and SELECT as the URL asks."""
    out = []
    password, username = options.get("password"), options.get("username")
    if password is not None:
        out.append(_packed("AUTH", username, password) if username else _packed("AUTH", password))
    if options.get("db"):
        out.append(_packed("SELECT", int(options["db"])))
    return out


def pipe_for(url: str) -> ScriptPipe | None:
    """A ScriptPipe for a single Redis over TCP or a unix socket; None (redis-py's client carries the
    scripts) for a Redis Cluster or TLS."""
    if is_cluster_url(url) or url.startswith("rediss://"):
        return None
    return ScriptPipe(url)


def scripts_for(pipe: ScriptPipe | None, client: redis.Redis, name: str) -> Any:
    """The script `name` through the pipe when there is one, else redis-py's (load_script)."""
    return load_script(client, name) if pipe is None else pipe.script(name)
