"""The cache's pure parts: policy validation, what a key is made of, and answers in and out."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops_gateway.cache import CachePolicyError, parse_policy, sse_events
from examlops_gateway.cache._replay import assemble, fresh, storable
from examlops_gateway.cache._request import exact_key, semantic_space, why_not_cached

EXACT = parse_policy("m", {"mode": "exact"})
CHAT = {"model": "m", "temperature": 0, "messages": [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": "hi there"}]}


def test_policy_defaults_and_refusals_name_the_field() -> None:
    p = parse_policy("m", {"mode": "semantic"})
    assert (p.embedding_model, p.threshold, p.ttl_s, p.scope, p.sampled) == ("minilm", 0.95, 600, "key", False)
    refused = [({"mode": "semantic", "threshold": 2}, "threshold"), ({"mode": "semantic", "threshold": 0}, "threshold"),
               ({"mode": "fuzzy"}, "mode"), ({"mode": "exact", "ttl_s": 1.5}, "ttl_s"),
               ({"mode": "exact", "scope": "all"}, "scope"), ({"mode": "exact", "sampled": "yes"}, "sampled"),
               ({"mode": "exact", "colour": 1}, "colour"), ({"mode": "exact", "threshold": True}, "threshold")]
    for body, field in refused:
        with pytest.raises(CachePolicyError) as exc:
            parse_policy("m", body)
        assert exc.value.field == field, body
    with pytest.raises(CachePolicyError):
        parse_policy("bad|model", {"mode": "exact"})


def test_the_exact_key_ignores_transport_fields_and_separates_scopes() -> None:
    base = exact_key("m", ["key", "k1"], CHAT)
    assert exact_key("m", ["key", "k1"], {**CHAT, "stream": True, "stream_options": {"include_usage": True},
                                          "user": "bob"}) == base
    assert exact_key("m", ["key", "k2"], CHAT) != base
    assert exact_key("m", ["tenant", "k1"], CHAT) != base
    assert exact_key("m", ["key", "k1"], {**CHAT, "max_tokens": 5}) != base
    assert exact_key("m", ["key", "k1"], dict(reversed(list(CHAT.items())))) == base  # canonical: key order


def test_only_deterministic_plain_text_requests_may_be_cached() -> None:
    assert why_not_cached(CHAT, EXACT) is None
    assert why_not_cached({**CHAT, "temperature": 0.7}, EXACT) == "sampled"
    assert why_not_cached({**CHAT, "temperature": 0.7, "seed": 1}, EXACT) is None
    assert why_not_cached({**CHAT, "temperature": 0.7}, parse_policy("m", {"mode": "exact", "sampled": True})) is None
    assert why_not_cached({**CHAT, "n": 2}, EXACT) == "n>1"
    assert why_not_cached({**CHAT, "tools": [{"type": "function"}]}, EXACT) == "tools"
    assert why_not_cached({**CHAT, "logprobs": True}, EXACT) == "logprobs"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert why_not_cached({**CHAT, "messages": [image]}, EXACT) == "media"
    assert why_not_cached({"model": "m", "prompt": "x", "temperature": 0}, EXACT) == "no messages"


def test_the_semantic_space_keeps_everything_but_the_last_user_turn_exact() -> None:
    space, text = semantic_space("m", ["key", "k"], "minilm", CHAT, CHAT) or ("", "")
    assert space.startswith("m|") and text == "hi there"
    other_turn = {**CHAT, "messages": [CHAT["messages"][0], {"role": "user", "content": "hello"}]}
    assert semantic_space("m", ["key", "k"], "minilm", other_turn, other_turn)[0] == space  # type: ignore[index]
    other_system = {**CHAT, "messages": [{"role": "system", "content": "be long"}, CHAT["messages"][1]]}
    assert semantic_space("m", ["key", "k"], "minilm", other_system, other_system)[0] != space  # type: ignore[index]
    assert semantic_space("m", ["key", "j"], "minilm", CHAT, CHAT)[0] != space  # type: ignore[index]
    assert semantic_space("m", ["key", "k"], "minilm", {**CHAT, "max_tokens": 3}, CHAT)[0] != space  # type: ignore[index]
    assistant_last = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "x"}]}
    assert semantic_space("m", ["key", "k"], "minilm", assistant_last, assistant_last) is None


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_a_stream_is_put_back_together_and_replayed_with_its_usage() -> None:
    chunks = [_chunk({"role": "assistant", "content": "Hel"}), _chunk({"content": "lo"}), _chunk({}, "stop"),
              orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": {}})]
    answer = assemble(chunks, pb.Usage(prompt_tokens=3, completion_tokens=2))
    assert answer is not None and storable(answer, client_bound=True)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events = sse_events(fresh(answer), include_usage=True).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    replay = [orjson.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in replay if c["choices"]) == "Hello"
    assert replay[-1]["usage"]["total_tokens"] == 5 and replay[-2]["choices"][0]["finish_reason"] == "stop"
    assert b"usage" not in sse_events(answer, include_usage=False)
    assert assemble([*chunks[:1], _chunk({"tool_calls": [{"index": 0}]}, "tool_calls")], None) is None
    assert assemble([chunks[0], orjson.dumps({"error": {"message": "x"}})], None) is None


def test_only_whole_plain_answers_are_kept() -> None:
    answer = {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                        "message": {"role": "assistant", "content": "x"}}]}
    assert storable(answer, client_bound=False)
    cut = {**answer, "choices": [{**answer["choices"][0], "finish_reason": "length"}]}  # type: ignore[dict-item]
    assert storable(cut, client_bound=True) and not storable(cut, client_bound=False)
    assert not storable({**answer, "choices": answer["choices"] * 2}, client_bound=True)
