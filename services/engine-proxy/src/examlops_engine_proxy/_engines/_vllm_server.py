"""vllm-server engine: a client of `vllm serve`'s OpenAI API (one pooled httpx client per endpoint).

Also serves any OpenAI-compatible server (SGLang's subclass adds its own parameters). Stream
chunks are forwarded as the raw bytes the server sent; each is parsed once, only to capture usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from examlops.engineproxy.v1 import engineproxy_pb2 as pb

from .._errors import AllBackendsFailed, EngineRejected
from ._base import Generation


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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def prepare(self, gen: Generation) -> dict[str, Any]:
        """The body sent to the server: usage is always asked for on streams (cost needs it)."""
        body = gen.body
        if gen.stream:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body = {**body, "stream_options": opts}
        return body

    async def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        body = orjson.dumps(self.prepare(gen))
        headers = {"Content-Type": "application/json"}
        try:
            request = self.client.build_request("POST", gen.path, content=body, headers=headers)
            response = await self.client.send(request, stream=gen.stream)
        except httpx.HTTPError as exc:
            raise AllBackendsFailed(self.endpoint, f"{type(exc).__name__} calling {self.base_url}: {exc}") from None
        try:
            if response.status_code >= 400:
                raw = await response.aread()
                self._raise_for(response.status_code, raw)
            if not gen.stream:
                raw = response.content
                try:
                    usage = _usage_pb(orjson.loads(raw).get("usage"))
                except (orjson.JSONDecodeError, AttributeError):
                    raise AllBackendsFailed(self.endpoint, "server answered with invalid JSON") from None
                yield pb.GenerateChunk(data=raw, final=True, usage=usage)
                return
            async for chunk in self._stream(response, gen.want_usage_chunk):
                yield chunk
        except httpx.HTTPError as exc:
            raise AllBackendsFailed(self.endpoint, f"{type(exc).__name__} while reading the answer: {exc}") from None
        finally:
            await response.aclose()

    async def _stream(self, response: httpx.Response, want_usage_chunk: bool) -> AsyncIterator[pb.GenerateChunk]:
        usage: pb.Usage | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            data = payload.encode()
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise AllBackendsFailed(self.endpoint, f"invalid stream chunk {payload[:200]!r}") from None
            if isinstance(obj, dict) and obj.get("error"):
                raise AllBackendsFailed(self.endpoint, f"engine error mid-stream: {_engine_message(data)}")
            if isinstance(obj, dict) and obj.get("usage"):
                usage = _usage_pb(obj["usage"])
                if not obj.get("choices") and not want_usage_chunk:
                    continue
            yield pb.GenerateChunk(data=data)
        yield pb.GenerateChunk(final=True, usage=usage)

    def _raise_for(self, status: int, raw: bytes) -> None:
        message = _engine_message(raw)
        if status in (400, 404, 413, 422):
            raise EngineRejected(f"endpoint:{self.endpoint} refused the request ({status}): {message}")
        raise AllBackendsFailed(self.endpoint, f"server answered {status}: {message}")

    async def aclose(self) -> None:
        await self.client.aclose()
