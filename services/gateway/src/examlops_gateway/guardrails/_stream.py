"""The output guardrail on the engine's chunks: a whole answer is scanned once; a streamed answer is
scanned incrementally with a hold-back window, so no matched text ever reaches the client, even a
match split across chunks.

Hold-back: every output detector declares the longest match it can make (`max_match_chars`, H).
Of a choice's text of length L, a match starting at or before L - H is wholly visible already, so
the text before L - H is decided: it is released (redacted where asked) unless a match straddles
the cut, which then moves back to the match's start. The rest waits for more text; the last H
released characters stay as context for the next scan. A choice's `finish_reason` (or the end of
the stream) flushes everything after a final scan. A `model` judge on the output needs the whole
answer, so with one the stream holds everything until the end. Released text goes in the
`content` (chat) or `text` (completion) of the chunk that brought new text, keeping the SSE
framing valid; a block raises GuardrailBlocked, which ends the stream with an SSE error event.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import grpc
import orjson

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._events import one_event_chunks
from ..governance import Ticket
from ._detectors import Finding, redact
from ._stage import Guard, GuardrailBlocked
from ._store import Rule

MIN_SCAN_CHARS = 16   # scan a choice again once this much new text (or H/4) has come


class _Held:
    """One choice's text not yet released, after up to H characters of released context."""

    __slots__ = ("ctx", "hold", "new", "text")

    def __init__(self, hold: int) -> None:
        self.text, self.ctx, self.hold, self.new = "", 0, hold, 0


class GuardedCall:
    """The engine call as the response reads it (read / cancel), with the output guardrail applied."""

    def __init__(self, call: Any, guard: Guard, ticket: Ticket) -> None:
        guard.ticket = ticket  # a retried attempt is a new ticket
        self.call, self.guard, self.stream = call, guard, ticket.stream
        self.rules: tuple[Rule, ...] = guard.applied.output
        self.hold = guard.applied.hold_chars
        self.whole = guard.applied.judged_output  # a judge sees the whole answer: hold it all
        self.every = max(MIN_SCAN_CHARS, self.hold // 4)
        self.held: dict[int, _Held] = {}
        self.queue: deque[Any] = deque()      # guarded chunks to return before reading on
        self.split: deque[Any] = deque()      # a message's chunks not yet guarded (one_event_chunks)
        self.shape: dict[str, Any] | None = None   # the last chunk, for a flush of its own
        self.chat = True

    def cancel(self) -> bool:
        return bool(self.call.cancel())

    async def read(self) -> Any:
        if self.queue:
            return self.queue.popleft()
        chunk = self.split.popleft() if self.split else await self.call.read()
        if not self.stream:
            return chunk if chunk is grpc.aio.EOF else await self.guard.check_answer(chunk)
        if chunk is not grpc.aio.EOF and chunk.sse:  # several chunks in one message: guarded one by one
            self.split.extend(one_event_chunks(chunk))
            chunk = self.split.popleft()
        if chunk is grpc.aio.EOF or chunk.final:
            flush = await self._flush(chunk)
            if flush is not None:
                self.queue.append(chunk)
                return flush
            return chunk
        return await self._pass(chunk)

    async def _pass(self, chunk: pb.GenerateChunk) -> pb.GenerateChunk:
        if not chunk.data:
            return chunk
        obj = orjson.loads(chunk.data)
        choices = obj.get("choices") or []
        if not choices:
            return chunk
        self.shape = obj
        for c in choices:
            if not isinstance(c, dict):
                continue
            self.chat = "delta" in c
            holder, key = (c.get("delta") or {}, "content") if self.chat else (c, "text")
            idx = int(c.get("index") or 0)
            held = self.held.setdefault(idx, _Held(self.hold))
            piece = holder.get(key)
            if isinstance(piece, str):
                held.text += piece
                held.new += len(piece)
            final = c.get("finish_reason") is not None
            released = await self._release(held, idx, final, chunk)
            if isinstance(piece, str) or released:
                holder[key] = released
        out = pb.GenerateChunk()
        out.CopyFrom(chunk)
        out.data = orjson.dumps(obj)
        return out

    async def _flush(self, chunk: Any) -> pb.GenerateChunk | None:
        """Whatever is still held when the stream ends, in a chunk of the last chunk's shape."""
        choices = []
        for idx, held in self.held.items():
            text = await self._release(held, idx, True, None if chunk is grpc.aio.EOF else chunk)
            if text:
                body = {"delta": {"content": text}} if self.chat else {"text": text}
                choices.append({"index": idx, **body, "finish_reason": None, "logprobs": None})
        if not choices or self.shape is None:
            return None
        obj = {k: v for k, v in self.shape.items() if k != "usage"}
        obj["choices"] = choices
        return pb.GenerateChunk(data=orjson.dumps(obj))

    async def _release(self, held: _Held, idx: int, final: bool, chunk: pb.GenerateChunk | None) -> str:
        """The text of one choice that may go now, redacted; raises GuardrailBlocked."""
        if not final and (self.whole or held.new < self.every):
            return ""
        held.new = 0
        hits = [(r, f) for r in self.rules if r.detector is not None for f in r.detector.scan(held.text)]
        for rule in self.rules if final else ():
            if rule.judge is not None:
                try:
                    hits += [(r, f) for r, _, f in await self.guard.judge(rule, [held.text], "output")]
                except GuardrailBlocked as exc:
                    exc.produced = chunk
                    raise
        hits = [(r, f) for r, f in hits if f.end > held.ctx or f.end == f.start]
        for rule, f in hits:
            if rule.entry.action == "block":
                self.guard.report(rule, f, "output")
                raise GuardrailBlocked(rule.policy, rule.entry.detector, f.entity, "output", f"choices[{idx}]",
                                       produced=chunk)
        cut = len(held.text) if final else max(held.ctx, len(held.text) - self.hold)
        moved = True
        while moved and not final:
            moved = False
            for _, f in hits:
                if f.start < cut < f.end:
                    cut, moved = max(held.ctx, f.start), True
        done = [(r, f) for r, f in hits if held.ctx <= f.start and f.end <= cut]
        redactions: list[Finding] = []
        for rule, f in done:
            self.guard.report(rule, f, "output")
            if rule.entry.action == "redact":
                redactions.append(Finding(f.detector, f.entity, f.start - held.ctx, f.end - held.ctx, f.score))
        released = redact(held.text[held.ctx:cut], redactions)
        keep = max(0, cut - self.hold) if not self.whole else 0
        held.text, held.ctx = held.text[keep:], cut - keep
        return released
