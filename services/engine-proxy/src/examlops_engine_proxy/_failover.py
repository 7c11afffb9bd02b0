"""One request over a pool: pick a replica, and before anything reached the caller, move to
another one when the server failed.

Retried on another replica not yet tried: connection errors, timeouts, 5xx and broken reads, as
long as no chunk has been yielded; at most EXAMLOPS_MAX_ATTEMPTS replicas (never more than the pool
holds) and never past the call's deadline. Never retried: a refusal of the request by the engine
(EngineRejected, 4xx), media and guardrail denials (raised before the pool is reached), an error
event inside a stream. Once a chunk has been yielded, a failure propagates: the caller (the
gateway) ends the stream with an error event. When every replica tried failed, PoolFailed names
`endpoint:<model>` and each replica with its error. Only one answer ever reaches the caller, so it
is charged once.

The first message names the replica that answers; on an endpoint with speculative decoding the
final message carries the call's SpecDecode (_spec_decode: the answering replica's counters from
its last scrape before the attempt to a scrape after the last byte, taken before the final message
is sent; a final message that brought stream chunks is split, so the chunks go on before the scrape).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ._engines import Generation
from ._errors import PoolFailed, ReplicaFailed
from ._replica_set import ReplicaSet
from ._replicas import Replica, scrape
from ._spec_decode import SPEC_SCRAPE_TIMEOUT_S, SpecCounters, spec_decode_between

#: Never start an attempt with less time than this left before the deadline.
MIN_ATTEMPT_S = 0.05
#: Attempts end this long before the call's deadline, so the caller gets the replicas' errors
#: rather than a bare DEADLINE_EXCEEDED.
DEADLINE_MARGIN_S = 0.1


@dataclass(frozen=True, slots=True)
class Attempts:
    """How one request may use its pool."""

    max_attempts: int
    eject_after: int                 # failures in a row that eject a replica
    first_byte_timeout_s: float      # 0: none
    deadline: float | None           # time.monotonic() when the call's deadline passes; None: none


async def generate_over(pool: ReplicaSet, gen: Generation, key: str | None,
                        rules: Attempts) -> AsyncIterator[pb.GenerateChunk]:
    """The answer's chunks from the first replica that gives one."""
    candidates = pool.candidates()
    if not candidates:  # every replica left the pool since the route was read
        raise PoolFailed(f"endpoint:{pool.endpoint}: no routable replica")
    limit = min(rules.max_attempts, len(candidates))
    failed: list[tuple[Replica, str]] = []
    while True:
        replica, reason = pool.pick(candidates, key)
        candidates = [c for c in candidates if c is not replica and not c.draining]
        if failed:
            reason = "retry"
        replica.start(reason)
        chunks = replica.engine.generate(gen)
        try:
            before = await _spec_window_start(pool, replica)
            try:
                first = await _first_chunk(chunks, rules)
            except ReplicaFailed as exc:
                if not exc.retryable:
                    raise
                _record_failure(replica, exc.kind, exc.detail, rules)
                failed.append((replica, exc.detail))
            except TimeoutError:
                if _out_of_time(rules):  # the caller's deadline, not the server's fault
                    failed.append((replica, "no first byte before the call's deadline"))
                else:
                    detail = f"no first byte within {rules.first_byte_timeout_s:g} s"
                    _record_failure(replica, "timeout", detail, rules)
                    failed.append((replica, detail))
            else:
                if replica.base_url:
                    replica.succeeded()
                first.replica = replica.id
                async for chunk in _answer(first, chunks, replica, before):
                    yield chunk
                return
        except ReplicaFailed as exc:  # after the first chunk (or not worth another replica)
            if exc.retryable and replica.base_url:
                _record_failure(replica, exc.kind, exc.detail, rules)
            raise PoolFailed(f"endpoint:{pool.endpoint}: replica {replica.id} ({replica.base_url}) failed "
                             f"{'mid-answer' if exc.retryable else 'the request'}: {exc.detail}") from None
        finally:
            replica.finish()
            await chunks.aclose()  # type: ignore[attr-defined]
        out_of_time = _out_of_time(rules)
        if len(failed) >= limit or not candidates or out_of_time:
            raise PoolFailed(_summary(pool, failed, out_of_time))
        replica.moved()


async def _spec_window_start(pool: ReplicaSet, replica: Replica) -> SpecCounters | None:
    """Where the call's speculative-decoding window starts: the replica's last scrape (one now if
    none has answered yet: the first call on a new pool); None without speculative decoding."""
    if not pool.spec_decode or not replica.base_url:
        return None
    if not replica.scraped:
        await scrape(replica, SPEC_SCRAPE_TIMEOUT_S)
    return replica.spec


async def _answer(first: pb.GenerateChunk, chunks: AsyncIterator[pb.GenerateChunk], replica: Replica,
                  before: SpecCounters | None) -> AsyncIterator[pb.GenerateChunk]:
    """The replica's messages as they come; the final one closes the SpecDecode window, after the
    stream chunks it carries went on (the closing scrape must not hold them back)."""
    chunk: pb.GenerateChunk | None = first
    while chunk is not None:
        if chunk.final and chunk.sse and before is not None:
            usage = chunk.usage if chunk.HasField("usage") else None
            chunk.final = False  # its events go on now, not copied
            yield chunk
            chunk = pb.GenerateChunk(final=True, usage=usage)
        yield await _ending(chunk, replica, before)
        chunk = await anext(chunks, None)


async def _ending(chunk: pb.GenerateChunk, replica: Replica, before: SpecCounters | None) -> pb.GenerateChunk:
    """The final message gets the call's SpecDecode (a scrape now closes its window)."""
    if chunk.final and before is not None:
        spec = spec_decode_between(before, await scrape(replica, SPEC_SCRAPE_TIMEOUT_S))
        if spec is not None:
            chunk.spec_decode.CopyFrom(spec)
    return chunk


async def _first_chunk(chunks: AsyncIterator[pb.GenerateChunk], rules: Attempts) -> pb.GenerateChunk:
    """The engine's first chunk, within the first-byte timeout and the call's deadline."""
    limit = rules.first_byte_timeout_s or None
    left = _time_left(rules)
    if left is not None:
        left = max(left, MIN_ATTEMPT_S)
        limit = min(limit, left) if limit else left
    if limit is None:
        return await anext(chunks)
    async with asyncio.timeout(limit):
        return await anext(chunks)


def _time_left(rules: Attempts) -> float | None:
    """Seconds left for attempts (None: no deadline)."""
    return None if rules.deadline is None else rules.deadline - DEADLINE_MARGIN_S - time.monotonic()


def _out_of_time(rules: Attempts) -> bool:
    left = _time_left(rules)
    return left is not None and left < MIN_ATTEMPT_S


def _record_failure(replica: Replica, kind: str, detail: str, rules: Attempts) -> None:
    if replica.base_url:  # an addressless engine has no server to eject
        replica.failed(kind, detail, rules.eject_after)


def _summary(pool: ReplicaSet, failed: list[tuple[Replica, str]], out_of_time: bool) -> str:
    """`endpoint:smol: all 2 replicas failed: r0 (http://..): connection refused; r1 (..): answered 503`"""
    size = len(pool.replicas)
    tried = "; ".join(f"{r.id} ({r.base_url}): {detail}" for r, detail in failed)
    if out_of_time:
        head = f"the call's deadline came after {len(failed)} of {size} replica(s) tried"
    elif len(failed) == size == 1:
        head = "its only replica failed"
    elif len(failed) >= size:
        head = f"all {size} replicas failed"
    else:
        head = f"{len(failed)} of {size} replicas tried (EXAMLOPS_MAX_ATTEMPTS), all failed"
    return f"endpoint:{pool.endpoint}: {head}: {tried}"

