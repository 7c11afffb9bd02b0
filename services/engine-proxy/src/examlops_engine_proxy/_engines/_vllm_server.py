"""vllm-server engine: a client of `vllm serve`'s OpenAI API (one pooled aiohttp session per endpoint).

Also serves any OpenAI-compatible server (SGLang's subclass adds its own parameters). Stream
chunks are forwarded as the raw bytes the server sent; each is parsed once, only to capture usage.
aiohttp rather than httpx: measured on this path, httpx cost ~1 ms of CPU per request in pool
bookkeeping and cancellation checks, aiohttp ~0.2 ms (bench/README.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._errors import AllBackendsFailed, EngineRejected
from ._base import Generation

_NET_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _usage_pb(usage: Any) -> pb.Usage | None:
    if not isinstance(usage, dict):
        return None
    return pb.Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0))


def _engine_message(body: bytes) -> str:
    try:
        err = orjson.loads(body)
        if isinstance(err, dict):
            inner = err.get("error", err)
            if isinstance(inner, dict) and inner.get("message"):
                return str(inner["message"])
            if err.get("message"):
                return str(err["message"])
    except orjson.JSONDecodeError:
        pass
    return body[:500].decode(errors="replace")


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

    @property
    def session(self) -> aiohttp.ClientSession:
        """Created on first use, inside the running event loop."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                                  json_serialize=lambda o: orjson.dumps(o).decode())
        return self._session

    def prepare(self, gen: Generation) -> dict[str, Any]:
        """The body sent to the server: usage is always asked for on streams (cost needs it)."""
        body = gen.body
        if gen.stream:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body = {**body, "stream_options": opts}
        return body

    async def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        url = self.base_url + gen.path
        try:
            response = await self.session.post(url, data=orjson.dumps(self.prepare(gen)), headers=self.headers)
        except _NET_ERRORS as exc:
            raise AllBackendsFailed(self.endpoint, f"{type(exc).__name__} calling {self.base_url}: {exc}") from None
        try:
            if response.status >= 400:
                self._raise_for(response.status, await response.read())
            if not gen.stream:
                raw = await response.read()
                try:
                    usage = _usage_pb(orjson.loads(raw).get("usage"))
                except (orjson.JSONDecodeError, AttributeError):
                    raise AllBackendsFailed(self.endpoint, "server answered with invalid JSON") from None
                yield pb.GenerateChunk(data=raw, final=True, usage=usage)
                return
            async for chunk in self._stream(response, gen.want_usage_chunk):
                yield chunk
        except _NET_ERRORS as exc:
            raise AllBackendsFailed(self.endpoint, f"{type(exc).__name__} while reading the answer: {exc}") from None
        finally:
            response.release()

    async def _stream(self, response: aiohttp.ClientResponse,
                      want_usage_chunk: bool) -> AsyncIterator[pb.GenerateChunk]:
        usage: pb.Usage | None = None
        done = False
        # Read to the end of the body even after [DONE], so the connection goes back to the pool.
        async for line in response.content:
            if done or not line.startswith(b"data:"):
                continue  # blank separators, comments, event names, the body's tail
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise AllBackendsFailed(self.endpoint, f"invalid stream chunk {payload[:200]!r}") from None
            if isinstance(obj, dict) and obj.get("error"):
                raise AllBackendsFailed(self.endpoint, f"engine error mid-stream: {_engine_message(payload)}")
            if isinstance(obj, dict) and obj.get("usage"):
                usage = _usage_pb(obj["usage"])
                if not obj.get("choices") and not want_usage_chunk:
                    continue
            yield pb.GenerateChunk(data=payload)
        yield pb.GenerateChunk(final=True, usage=usage)

    def _raise_for(self, status: int, raw: bytes) -> None:
        message = _engine_message(raw)
        if status in (400, 404, 413, 422):
            raise EngineRejected(f"endpoint:{self.endpoint} refused the request ({status}): {message}")
        raise AllBackendsFailed(self.endpoint, f"server answered {status}: {message}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
