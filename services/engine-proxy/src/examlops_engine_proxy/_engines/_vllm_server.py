"""vllm-server engine: a client of `vllm serve`'s OpenAI API (per replica: a pool of kept-alive
connections for the generations, _http.py, and an aiohttp session for https:// and the rest).

Also serves any OpenAI-compatible server (SGLang's subclass adds its own parameters). A stream is
read per network read: the events each read completes go on as one message, as the bytes the server
sent, parsed only where usage or an error must be read (_sse).

Streams ask for continuous usage (`stream_options: {include_usage, continuous_usage_stats}`, vLLM
and SGLang), so every chunk carries the tokens delivered so far: a stream cut by the client or by an
engine failure is billed what was delivered, not guessed. The usage fields the client did not ask
for are stripped from what it receives (that chunk is re-serialised), so it sees what it asked for.
The client, measured on this path (engine-proxy's CPU per request to the benchmark's stub, one
core): httpx ~1 ms (pool bookkeeping, cancellation checks), aiohttp ~119 µs whole and ~164 µs
streamed, the lean pool ~32 µs and ~74 µs (including this module's own work on the answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops.svc import with_trace_context

from .._errors import EngineRejected, ReplicaFailed
from ._base import Generation
from ._http import HttpPool, NetFailure
from ._sse import EventReader, engine_message, usage_pb

NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, NetFailure)


def net_failure(exc: BaseException) -> tuple[str, str]:
    """(kind, short description) of a network error: `connect` when no connection was made (a
    refused or timed-out connect means nothing answers there), else `timeout` or `read`."""
    if isinstance(exc, NetFailure):
        return exc.kind, exc.detail
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error, ConnectionRefusedError):
            return "connect", "connection refused"
        return "connect", f"cannot connect ({os_error.strerror or type(os_error).__name__})"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connect", "connect timed out"
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout", "timed out waiting for the server"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "read", "server disconnected"
    return "read", f"{type(exc).__name__}: {exc}".rstrip(": ")


class VllmServerEngine:
    name = "vllm-server"

    def __init__(self, endpoint: str, base_url: str, *, api_key: str = "", connect_timeout_s: float = 3.0,
                 read_timeout_s: float = 600.0, max_connections: int = 256) -> None:
        self.endpoint = endpoint
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # generations to an http:// server take the lean client (_http.py); https:// ones, aiohttp
        # (the engine's key goes into the pool's header lines, encoded once)
        plain = self.base_url.startswith("http://") and "@" not in urlsplit(self.base_url).netloc
        self.pool = HttpPool(self.base_url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s,
                             max_connections=max_connections, headers=self.headers) if plain else None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                                  json_serialize=lambda o: orjson.dumps(o).decode())
        return self._session

    def prepare(self, gen: Generation) -> dict[str, Any]:
        """The body sent to the server: streams always ask for continuous usage (cost needs it)."""
        body = gen.body
        if gen.stream:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = opts["continuous_usage_stats"] = True
            body = {**body, "stream_options": opts}
        return body

    async def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        response: Any
        try:
            # The engine joins the caller's trace (vLLM with --otlp-traces-endpoint) through `traceparent`.
            body = orjson.dumps(self.prepare(gen))
            if self.pool is not None:  # the pool sends self.headers itself
                response = await self.pool.post(gen.path, with_trace_context({}), body)
            else:
                response = await self.session.post(self.base_url + gen.path, data=body,
                                                   headers=with_trace_context(self.headers))
        except NET_ERRORS as exc:
            raise self.failed(*net_failure(exc)) from None
        try:
            if response.status >= 400:
                self._raise_for(response.status, await response.read())
            if not gen.stream:
                raw = await response.read()
                try:
                    usage = usage_pb(orjson.loads(raw).get("usage"))
                except (orjson.JSONDecodeError, AttributeError):
                    raise self.failed("protocol", "server answered with invalid JSON") from None
                yield pb.GenerateChunk(data=raw, final=True, usage=usage)
                return
            async for chunk in self._stream(response, gen):
                yield chunk
        except NET_ERRORS as exc:
            kind, detail = net_failure(exc)
            raise self.failed(kind, f"{detail} while reading the answer") from None
        finally:
            response.release()

    async def _stream(self, response: Any, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        """One message per read that completed events; the last is final (with that read's events
        when [DONE] and the body's end came in it). The body is read to its end even after [DONE],
        so the connection goes back to the pool."""
        events = EventReader(gen, self.failed)
        content = response.content
        async for data in content.iter_any():
            sse = events.feed(data)
            if events.error is not None:
                if sse:
                    yield pb.GenerateChunk(sse=sse, usage=events.usage)
                raise events.error
            if events.done and content.at_eof():
                yield pb.GenerateChunk(sse=sse, usage=events.usage, final=True)
                return
            if sse:
                yield pb.GenerateChunk(sse=sse, usage=events.usage)
        sse = events.finish()
        if events.error is not None:
            if sse:
                yield pb.GenerateChunk(sse=sse, usage=events.usage)
            raise events.error
        yield pb.GenerateChunk(sse=sse, usage=events.usage, final=True)

    def _raise_for(self, status: int, raw: bytes) -> None:
        message = engine_message(raw)
        if status in (400, 404, 413, 422):
            raise EngineRejected(f"endpoint:{self.endpoint} refused the request ({status}): {message}")
        raise self.failed("status", f"answered {status}: {message}", status)

    def failed(self, kind: str, detail: str, status: int = 0) -> ReplicaFailed:
        return ReplicaFailed(self.endpoint, self.base_url, kind, detail, status)

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """GET a server path (/metrics, /health) on this engine's session: (status, body)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(self.base_url + path, timeout=timeout, headers=self.headers) as response:
            return response.status, await response.read()

    async def aclose(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self._session is not None:
            await self._session.close()
