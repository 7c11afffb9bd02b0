"""engine-proxy's stream messages seen as stream chunks, for the readers that look at each chunk.

A message carries either ready-to-send SSE frames in `sse` (every chunk one read of the engine
brought, each exactly `data: <JSON>\\n\\n`) or one chunk's JSON in `data`. The plain path sends
`frames` as they are; only a reader that must see each chunk (usage bound, cache tap, structured
output, output guardrail) splits a message with `events_of` or `one_event_chunks`.
"""

from __future__ import annotations

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

_PREFIX = len(b"data: ")


def frames(chunk: pb.GenerateChunk) -> bytes:
    """What one message sends an SSE client (b"" when it carries no chunk)."""
    if chunk.sse:
        return chunk.sse
    return b"data: " + chunk.data + b"\n\n" if chunk.data else b""


def events_of(chunk: pb.GenerateChunk) -> list[bytes]:
    """The JSON of each stream chunk one message carries, in order."""
    if chunk.sse:
        return [frame[_PREFIX:] for frame in chunk.sse.split(b"\n\n") if frame]
    return [chunk.data] if chunk.data else []


def one_event_chunks(chunk: pb.GenerateChunk) -> list[pb.GenerateChunk]:
    """A message as one message per stream chunk (its `data`), for a reader of single chunks: the
    first gets the first message's fields, the last chunk the message's usage, and a final message
    ends with a final message of its own (no chunk, its usage and SpecDecode)."""
    payloads = events_of(chunk)
    if not payloads:
        return [chunk]
    out = [pb.GenerateChunk(data=p) for p in payloads]
    head, last = out[0], out[-1]
    head.replica, head.media_parts_dropped = chunk.replica, chunk.media_parts_dropped
    head.warnings.extend(chunk.warnings)
    if chunk.HasField("usage"):
        last.usage.CopyFrom(chunk.usage)
    if chunk.final:
        tail = pb.GenerateChunk()
        tail.CopyFrom(chunk)
        tail.ClearField("sse")
        tail.ClearField("data")
        del tail.warnings[:]
        out.append(tail)
    return out
