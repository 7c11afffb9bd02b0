"""A fast OpenAI-compatible stub server: the backend of the gateway overhead benchmark.

It answers in microseconds so that what the benchmark measures is the path in front of it, not it.
Raw asyncio protocol (uvloop when installed), HTTP/1.1 keep-alive, no framework:

    POST /v1/chat/completions   a fixed small chat.completion with usage; with "stream": true a few
                                SSE chunks, a usage chunk when stream_options.include_usage (and the
                                running usage on every chunk with continuous_usage_stats, as vLLM), [DONE]
    POST /v1/completions        the same for text_completion
    GET  /v1/models             the one model the stub pretends to serve
    GET  /health                200, empty body (as vLLM answers)
    GET  /stats                 {"connections": accepted so far, "requests": answered so far}

The answer's "model" echoes the request's. Responses are built once per (path, model, stream,
include_usage) and cached. Bodies must carry Content-Length (chunked request bodies get 411).

    python bench/stub_backend.py --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from typing import Any

try:
    import orjson

    def _loads(raw: bytes) -> Any:
        return orjson.loads(raw)

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # the stub also runs with the standard library alone
    def _loads(raw: bytes) -> Any:
        return json.loads(raw)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
CREATED = int(time.time())
TOKENS = ["Hello", " from", " the", " stub", "."]
PROMPT_TOKENS = 12


def _usage() -> dict[str, int]:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(TOKENS),
            "total_tokens": PROMPT_TOKENS + len(TOKENS)}


def _head(status: str, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"content-type: {content_type}", "server: examlops-bench-stub"]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    lines.append("connection: keep-alive" if keep_alive else "connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _plain(status: str, body: bytes, keep_alive: bool, content_type: str = "application/json") -> bytes:
    return _head(status, content_type, len(body), keep_alive) + body


def _error(status: str, message: str, keep_alive: bool) -> bytes:
    body = _dumps({"error": {"message": message, "type": "invalid_request_error", "code": None, "param": None}})
    return _plain(status, body, keep_alive)


def _chat_json(model: str) -> bytes:
    return _dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": CREATED, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(TOKENS)},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": _usage(),
    })


def _completion_json(model: str) -> bytes:
    return _dumps({
        "id": "cmpl-bench", "object": "text_completion", "created": CREATED, "model": model,
        "choices": [{"index": 0, "text": "".join(TOKENS), "logprobs": None, "finish_reason": "stop"}],
        "usage": _usage(),
    })


def _chat_events(model: str, include_usage: bool, continuous: bool = False) -> list[bytes]:
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, done: int = 0) -> dict[str, Any]:
        out = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if continuous:  # vLLM's continuous_usage_stats: the running usage on every chunk
            out["usage"] = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": done,
                            "total_tokens": PROMPT_TOKENS + done}
        return out

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": tok}, done=i + 1) for i, tok in enumerate(TOKENS)]
    events.append(chunk({}, "stop", len(TOKENS)))
    if include_usage:
        events.append({**base, "choices": [], "usage": _usage()})
    return [b"data: " + _dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _completion_events(model: str, include_usage: bool) -> list[bytes]:
    base = {"id": "cmpl-bench", "object": "text_completion", "created": CREATED, "model": model}
    events: list[dict[str, Any]] = [
        {**base, "choices": [{"index": 0, "text": tok, "logprobs": None, "finish_reason": None}]} for tok in TOKENS]
    events.append({**base, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]})
    if include_usage:
        events.append({**base, "choices": [], "usage": _usage()})
    return [b"data: " + _dumps(e) + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def _chunked(events: list[bytes]) -> bytes:
    """The SSE events as HTTP/1.1 chunks, one chunk per event, then the last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


_cache: dict[tuple[bytes, str, bool, bool, bool, bool], bytes] = {}
#: what /stats reports: a client that pools its connections opens few of them
STATS = {"connections": 0, "requests": 0}


def _generation(path: bytes, body: bytes, keep_alive: bool) -> bytes:
    try:
        req = _loads(body)
    except ValueError:
        return _error("400 Bad Request", "request body is not valid JSON", keep_alive)
    if not isinstance(req, dict) or not isinstance(req.get("model"), str):
        return _error("400 Bad Request", "model: field required", keep_alive)
    model = req["model"]
    stream = req.get("stream") is True
    opts = req.get("stream_options")
    include_usage = stream and isinstance(opts, dict) and opts.get("include_usage") is True
    continuous = include_usage and opts.get("continuous_usage_stats") is True  # type: ignore[union-attr]
    key = (path, model, stream, include_usage, continuous, keep_alive)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    chat = path == b"/v1/chat/completions"
    if stream:
        events = _chat_events(model, include_usage, continuous) if chat else _completion_events(model, include_usage)
        out = _head("200 OK", "text/event-stream", None, keep_alive) + _chunked(events)
    else:
        out = _plain("200 OK", _chat_json(model) if chat else _completion_json(model), keep_alive)
    if len(_cache) < 1024:
        _cache[key] = out
    return out


def respond(method: bytes, target: bytes, body: bytes, keep_alive: bool) -> bytes:
    path = target.split(b"?", 1)[0]
    if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
        STATS["requests"] += 1
        return _generation(path, body, keep_alive)
    if method == b"GET" and path == b"/health":
        return _plain("200 OK", b"", keep_alive)
    if method == b"GET" and path == b"/stats":
        return _plain("200 OK", _dumps(STATS), keep_alive)
    if method == b"GET" and path == b"/v1/models":
        return _plain("200 OK", _dumps({"object": "list", "data": [
            {"id": "bench", "object": "model", "created": CREATED, "owned_by": "examlops-bench"}]}), keep_alive)
    if path in (b"/v1/chat/completions", b"/v1/completions", b"/health", b"/v1/models"):
        return _error("405 Method Not Allowed", f"{method.decode()} is not allowed here", keep_alive)
    return _error("404 Not Found", f"no route {path.decode(errors='replace')}", keep_alive)


class StubProtocol(asyncio.Protocol):
    """One connection: parse pipelined HTTP/1.1 requests off the buffer, answer each in order."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport subclasses

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        STATS["connections"] += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        transport = self.transport
        assert transport is not None
        while self.buf:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._fail(b"431 Request Header Fields Too Large")
                return
            lines = bytes(self.buf[:end]).split(b"\r\n")
            try:
                method, target, version = lines[0].split(b" ", 2)
            except ValueError:
                self._fail(b"400 Bad Request")
                return
            length = 0
            keep_alive = version == b"HTTP/1.1"
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    try:
                        length = int(value)
                    except ValueError:
                        self._fail(b"400 Bad Request")
                        return
                elif name == b"connection":
                    token = value.strip().lower()
                    keep_alive = token != b"close" and (keep_alive or token == b"keep-alive")
                elif name == b"transfer-encoding":
                    self._fail(b"411 Length Required")
                    return
            if length > MAX_BODY:
                self._fail(b"413 Content Too Large")
                return
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = bytes(self.buf[end + 4:total])
            del self.buf[:total]
            transport.write(respond(method, target, body, keep_alive))
            if not keep_alive:
                transport.close()
                return

    def _fail(self, status: bytes) -> None:
        assert self.transport is not None
        self.transport.write(_error(status.decode(), status.decode(), keep_alive=False))
        self.transport.close()
        self.buf.clear()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(StubProtocol, host, port, backlog=1024, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    print(f"stub ready on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stdout)")
    ap.add_argument("--no-uvloop", action="store_true", help="use the standard asyncio event loop")
    args = ap.parse_args(argv)
    loop_factory = None
    if not args.no_uvloop:
        try:
            import uvloop
            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
