"""An OpenAI server's SSE answer, read per network read and parsed only where it must be.

Each read's complete events go on as one ready-to-send `sse` block (a partial event waits for the
rest of it in the next read; a complete one never waits). Most events are not parsed at all:

- vLLM (and SGLang) write compact JSON with the running usage (continuous_usage_stats) as the last
  key of every chunk, `...,"usage":{...}}`. A `"` inside a JSON string is always escaped, so the
  last `,"usage":` with bare quotes is structural; what follows it, less the closing `}`, must
  parse as one object (else the event is parsed whole). Stripping it is cutting the bytes there.
- The usage of a read is that of its last chunk (for a single choice: with n > 1 or a list of
  prompts, the usage counts per choice and every event is parsed, RunningUsage).
- Parsed whole, as before: an event that mentions "error" (a mid-stream error raises), the final
  usage chunk ("choices":[]), a chunk whose usage is not last, anything not written as above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._errors import ReplicaFailed
from ._base import Generation

USAGE_KEY = b',"usage":'
_TAIL = len(USAGE_KEY)
_BAD = object()  # the bytes after `,"usage":` are not one value closing the chunk


def usage_pb(usage: Any) -> pb.Usage | None:
    if not isinstance(usage, dict):
        return None
    return pb.Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                    completion_tokens=int(usage.get("completion_tokens") or 0))


def engine_message(body: bytes) -> str:
    """The message of an engine's error body (OpenAI's error shape or a bare message)."""
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


def usage_tail(payload: bytes, at: int) -> Any:
    """The value after the `,"usage":` at `at` when it is the chunk's last key; _BAD when it is not."""
    if payload[-1:] != b"}":
        return _BAD
    try:
        return orjson.loads(payload[at + _TAIL:-1])
    except orjson.JSONDecodeError:
        return _BAD


def strip_usage(payload: bytes) -> bytes:
    """The chunk without its "usage" key: cut at the byte level when usage is last, else re-serialised."""
    at = payload.rfind(USAGE_KEY)
    if at >= 0 and usage_tail(payload, at) is not _BAD:
        return payload[:at] + b"}"
    obj = orjson.loads(payload)
    del obj["usage"]
    return orjson.dumps(obj)


class RunningUsage:
    """The usage delivered so far, from vLLM's continuous usage stats, which count per choice: a
    chunk of choice `index` carries its prompt's tokens and that choice's completion tokens so far
    (`index = prompt_index * n + choice`, for a list of prompts on /v1/completions)."""

    __slots__ = ("completion", "n", "prompt")

    def __init__(self, n: Any) -> None:
        self.n = n if isinstance(n, int) and n > 1 else 1
        self.prompt: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, usage: dict[str, Any], choices: list[Any]) -> pb.Usage:
        """The running total after a chunk of one choice that carried `usage`."""
        index = choices[0].get("index", 0) if isinstance(choices[0], dict) else 0
        index = index if isinstance(index, int) else 0
        self.prompt[index // self.n] = int(usage.get("prompt_tokens") or 0)
        self.completion[index] = int(usage.get("completion_tokens") or 0)
        return pb.Usage(prompt_tokens=sum(self.prompt.values()), completion_tokens=sum(self.completion.values()))


def _usage_of(payload: bytes) -> Any:
    """A chunk's usage: its tail when usage is last, else from the whole chunk (None: not JSON)."""
    usage = usage_tail(payload, payload.rfind(USAGE_KEY))
    if usage is not _BAD:
        return usage
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return obj.get("usage") if isinstance(obj, dict) else None


def _many_choices(gen: Generation) -> bool:
    """Several choices stream at once: n > 1, or a list of prompts on /v1/completions. An n other
    than absent or 1 counts as several: the engine may take "2" or 2.0 for 2."""
    n, prompt = gen.body.get("n"), gen.body.get("prompt")
    return n not in (None, 1) or (
        isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int))


class EventReader:
    """Turns the reads of one streamed answer into ready-to-send SSE blocks; `usage` is the running
    usage after the last event given out, `done` whether [DONE] came, `error` the failure that
    ended the stream (the events before it are given out first)."""

    __slots__ = ("done", "error", "fail", "last", "many", "pending", "running", "strip", "usage", "want_chunk")

    def __init__(self, gen: Generation, fail: Callable[[str, str], ReplicaFailed]) -> None:
        self.fail = fail
        self.many = _many_choices(gen)
        self.running = RunningUsage(gen.body.get("n"))
        self.strip = not gen.want_usage_stats
        self.want_chunk = gen.want_usage_chunk
        self.usage: pb.Usage | None = None
        self.last: bytes | dict[str, Any] | None = None  # the latest chunk usage not yet in `usage`
        self.done = False
        self.error: ReplicaFailed | None = None
        self.pending: list[bytes] = []  # the reads of an event not yet complete

    def feed(self, data: bytes) -> bytes:
        """The complete events so far, as `data: {...}\\n\\n` frames; b"" when none completed.
        A long event's reads are kept apart until its end comes, each read scanned once (joining them
        on every read would cost the square of the event's size)."""
        pending = self.pending
        if pending:
            last = pending[-1][-1:]
            pending.append(data)
            if b"\n\n" not in data and b"\r" not in data and last != b"\r" and last + data[:1] != b"\n\n":
                return b""
            data = b"".join(pending)
            pending.clear()
        if b"\r" in data:  # CRLF-framed events (a CR alone at the end waits for its LF)
            data = data.replace(b"\r\n", b"\n")
        end = data.rfind(b"\n\n")
        if end < 0:
            pending.append(data)
            return b""
        end += 2
        if end < len(data):
            pending.append(data[end:])
            return self._events(data[:end])
        return self._events(data)

    def finish(self) -> bytes:
        """The body ended: an event left without its blank line still counts."""
        rest = b"".join(self.pending)
        self.pending.clear()
        return self._events(rest + b"\n\n") if rest.strip() else b""

    def _events(self, block: bytes) -> bytes:
        if self.done:
            return b""  # read to the end for the connection's sake; nothing after [DONE] counts
        out: list[bytes] = []
        same = True  # every event kept byte for byte in its canonical frame: `block` is sent as is
        frames = block.split(b"\n\n")
        frames.pop()  # the block ends with a separator
        try:
            for frame in frames:
                if frame.startswith(b"data: ") and frame.find(b"\n") < 0:
                    payloads = [frame[6:]]
                else:  # blank lines, comments, event names, several data lines: each data line is an event
                    same = False
                    payloads = [line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:")]
                for payload in payloads:
                    if payload == b"[DONE]":
                        self.done, same = True, False
                        break
                    kept = self._event(payload)
                    if kept is not payload:
                        same = False
                    if kept is not None:
                        out.append(kept)
                if self.done:
                    break
        except ReplicaFailed as exc:
            self.error, same = exc, False
        last, self.last = self.last, None
        if isinstance(last, bytes):
            last = _usage_of(last)
        if isinstance(last, dict):
            self.usage = usage_pb(last)
        if same:
            return block
        return b"".join([b"data: " + p + b"\n\n" for p in out])

    def _event(self, payload: bytes) -> bytes | None:
        """The event as it goes on (the same object when unchanged; None: dropped)."""
        if self.many or payload[-1:] != b"}" or b'"error"' in payload or b'"choices":[]' in payload:
            return self._parsed(payload)
        at = payload.rfind(USAGE_KEY)
        if at < 0:
            return self._parsed(payload) if b'"usage"' in payload else payload
        if not self.strip:
            if payload[at + _TAIL:at + _TAIL + 4] != b"null":  # "usage":null leaves the usage before it
                self.last = payload  # its usage is read only if it is the read's last
            return payload
        usage = usage_tail(payload, at)
        if usage is _BAD:
            return self._parsed(payload)
        if not isinstance(usage, dict):  # "usage":null
            return payload
        self.last = usage
        return payload[:at] + b"}"

    def _parsed(self, payload: bytes) -> bytes | None:
        """An event parsed whole: errors raise, the final usage chunk, per-choice usage."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise self.fail("protocol", f"invalid stream chunk {payload[:200]!r}") from None
        if not isinstance(obj, dict):
            return payload
        if obj.get("error"):
            raise self.fail("engine", f"engine error mid-stream: {engine_message(payload)}")
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return payload
        self.last = None
        choices = obj.get("choices")
        if not choices:  # the final usage chunk: the whole call's usage
            self.usage = usage_pb(usage)
            return payload if self.want_chunk else None
        self.usage = self.running.add(usage, choices)
        return strip_usage(payload) if self.strip else payload
