"""The byte-level reading of an engine's SSE answer (_engines/_sse): usage cut out of the bytes
gives exactly what removing it from the JSON gives, usage is read right for one choice and for
many, and whatever is not written as vLLM writes it is parsed whole."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops_engine_proxy._engines import Generation
from examlops_engine_proxy._engines._sse import EventReader, strip_usage
from examlops_engine_proxy._errors import ReplicaFailed

TRICKY = ['plain', 'say "hi"', 'a \\ backslash', '"usage":{"prompt_tokens":1}}', ',"usage":', 'ünïcødé 🙂',
          '}', '{"usage":null}', 'tab\tnew\nline', 'error', '"choices":[]']


def vllm_chunk(text: str, done: int, index: int = 0, usage: bool = True) -> bytes:
    """A chat chunk as vLLM serialises it (compact JSON, usage the last key)."""
    obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": [{"index": index, "delta": {"content": text, "tool_calls": [
                               {"index": 0, "function": {"arguments": orjson.dumps({"q": text}).decode()}}]},
                               "logprobs": None, "finish_reason": None}]}
    if usage:
        obj["usage"] = {"prompt_tokens": 5, "total_tokens": 5 + done, "completion_tokens": done,
                        "prompt_tokens_details": {"cached_tokens": 0}}
    return orjson.dumps(obj)


def json_strip(payload: bytes) -> bytes:
    obj = orjson.loads(payload)
    obj.pop("usage", None)
    return orjson.dumps(obj)


def reader(stats: bool = False, usage_chunk: bool = True, **body: Any) -> EventReader:
    gen = Generation(kind=pb.REQUEST_KIND_CHAT, body=body, stream=True, want_usage_chunk=usage_chunk,
                     want_usage_stats=stats, endpoint="m")
    return EventReader(gen, lambda kind, detail: ReplicaFailed("m", "http://x", kind, detail))


def frames(payloads: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


@pytest.mark.parametrize("text", TRICKY)
def test_cutting_usage_out_of_the_bytes_equals_removing_it_from_the_json(text: str) -> None:
    payload = vllm_chunk(text, 3)
    assert strip_usage(payload) == json_strip(payload)
    events = reader()
    assert events.feed(frames([payload])) == frames([json_strip(payload)])
    assert (events.usage.prompt_tokens, events.usage.completion_tokens) == (5, 3)  # type: ignore[union-attr]


def test_a_whole_stream_of_tricky_chunks_reads_as_the_json_says() -> None:
    payloads = [vllm_chunk(t, i + 1) for i, t in enumerate(TRICKY)]
    final = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                          "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 11}})
    body = frames([*payloads, final]) + b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(body)):  # any way the network cuts it
        events = reader()
        out = b"".join(events.feed(body[i:i + size]) for i in range(0, len(body), size)) + events.finish()
        assert out == frames([json_strip(p) for p in payloads] + [final])
        assert events.done and events.usage is not None and events.usage.completion_tokens == 11
        kept = reader(stats=True)
        assert b"".join(kept.feed(body[i:i + size]) for i in range(0, len(body), size)) == frames([*payloads, final])


def test_a_read_s_usage_is_its_last_chunk_s_and_the_usage_chunk_only_when_asked() -> None:
    payloads = [vllm_chunk("a", 1), vllm_chunk("b", 2)]
    final = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    events = reader(stats=True, usage_chunk=False)
    assert events.feed(frames(payloads)) == frames(payloads)  # the bytes as they came
    assert events.usage is not None and events.usage.completion_tokens == 2
    assert events.feed(frames([final])) == b""
    assert events.usage.completion_tokens == 2 and events.usage.prompt_tokens == 5


def test_usage_not_written_last_or_not_compact_is_parsed_whole() -> None:
    first = orjson.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 1}, "choices": [{"index": 0}]})
    spaced = b'{"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": {"prompt_tokens": 5, ' \
             b'"completion_tokens": 2}}'
    nested = orjson.dumps({"choices": [{"index": 0, "x": {"a": 1, "usage": {"b": 2}}}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "tail": 1})
    for payload, done in ((first, 1), (spaced, 2), (nested, 3)):
        events = reader()
        assert events.feed(frames([payload])) == frames([json_strip(payload)])
        assert events.usage is not None and events.usage.completion_tokens == done
    null = vllm_chunk("x", 0, usage=False)[:-1] + b',"usage":null}'  # no usage: passed on as it is
    assert reader().feed(frames([null])) == frames([null])


def test_several_choices_keep_their_per_choice_usage() -> None:
    # n=2: each choice's chunks carry that choice's completion tokens; the total is their sum
    events = reader(n=2)
    out = events.feed(frames([vllm_chunk("a", 1, index=0), vllm_chunk("b", 1, index=1), vllm_chunk("c", 2, index=0)]))
    assert out == frames([json_strip(vllm_chunk(t, d, index=i)) for t, d, i in (("a", 1, 0), ("b", 1, 1), ("c", 2, 0))])
    assert events.usage is not None and (events.usage.prompt_tokens, events.usage.completion_tokens) == (5, 3)
    # a list of prompts on /v1/completions: the prompts' tokens add up as well
    many = reader(prompt=["p0", "p1"])
    many.feed(frames([vllm_chunk("a", 1, index=0), vllm_chunk("b", 4, index=1)]))
    assert many.usage is not None and (many.usage.prompt_tokens, many.usage.completion_tokens) == (10, 5)


def test_an_error_event_ends_the_read_after_the_events_before_it() -> None:
    events = reader()
    good = vllm_chunk("a", 1)
    out = events.feed(frames([good, b'{"error":{"message":"boom"}}', vllm_chunk("b", 2)]))
    assert out == frames([json_strip(good)])
    assert events.error is not None and events.error.kind == "engine" and "boom" in events.error.detail
    broken = reader()
    assert broken.feed(b"data: not json\n\n") == b""
    assert broken.error is not None and broken.error.kind == "protocol"


def test_framing_other_than_vllm_s_is_read_line_by_line() -> None:
    payload = vllm_chunk("x", 1, usage=False)
    events = reader()
    assert events.feed(b": keep-alive\r\n\r\nevent: message\r\ndata:" + payload + b"\r\n\r\n") == frames([payload])
    assert events.feed(b"data: " + payload) == b""  # no blank line yet: it may go on
    assert events.finish() == frames([payload])  # the body ended: it counts


def test_a_chunk_with_null_usage_last_in_a_read_keeps_the_usage_before_it() -> None:
    # the usage of a read is that of its last chunk with usage, whether the client asked for the
    # running usage (kept in the bytes) or not (cut out)
    null = vllm_chunk("b", 0, usage=False)[:-1] + b',"usage":null}'
    for stats in (False, True):
        events = reader(stats=stats)
        events.feed(frames([vllm_chunk("a", 4), null]))
        assert events.usage is not None and events.usage.completion_tokens == 4, stats


@pytest.mark.parametrize("n", ["2", 2.0])
def test_an_n_the_engine_coerces_is_read_as_several_choices(n: Any) -> None:
    # vLLM's request model takes "2" and 2.0 for n=2 (lax validation): the choices' usage still adds up
    events = reader(n=n)
    events.feed(frames([vllm_chunk("a", 1, index=0), vllm_chunk("b", 1, index=1), vllm_chunk("c", 2, index=0)]))
    assert events.usage is not None and events.usage.completion_tokens == 3


@pytest.mark.parametrize("crlf", [False, True])
def test_any_split_into_reads_gives_the_frames_of_one_read(crlf: bool) -> None:
    body = frames([vllm_chunk(t, i + 1) for i, t in enumerate(TRICKY[:4])]) + b"data: [DONE]\n\n"
    if crlf:
        body = body.replace(b"\n", b"\r\n")
    whole = reader(stats=True)
    expected = whole.feed(body) + whole.finish()
    for size in (1, 2, 3, 7, 64):
        r = reader(stats=True)
        got = b"".join(r.feed(body[at:at + size]) for at in range(0, len(body), size)) + r.finish()
        assert (got, r.usage, r.done) == (expected, whole.usage, whole.done), size


def test_a_long_event_s_reads_are_joined_once_when_its_end_comes() -> None:
    event = b"data: " + vllm_chunk("x" * 200_000, 1) + b"\n\n"
    r = reader(stats=True)
    reads = [event[at:at + 4096] for at in range(0, len(event), 4096)]
    for data in reads[:-1]:
        assert r.feed(data) == b""
    assert len(r.pending) == len(reads) - 1  # kept apart, not rebuilt on every read
    assert r.feed(reads[-1]) == event and not r.pending
