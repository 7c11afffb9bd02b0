"""Pure parts of gateway governance: key format, cost arithmetic, the prompt bound, max_tokens."""

from __future__ import annotations

import orjson
import pytest

from examlops_gateway.governance import (
    ID_LEN,
    Price,
    cost_micro_usd,
    digest,
    estimate_prompt_tokens,
    new_key,
    parse_key,
    with_max_tokens,
)
from examlops_gateway.http import ChatCompletionRequest, CompletionRequest


def test_virtual_key_format_and_parse() -> None:
    key_id, token = new_key()
    assert len(key_id) == ID_LEN and token.startswith(f"sk-exa-{key_id}-")
    assert parse_key(token) == key_id
    assert digest(token) != digest(token + "x") and len(digest(token)) == 64
    for bad in ("", "sk-exa-", "sk-exa-0123456789ab", "sk-exa-0123456789abX-s", "sk-exa-XYZ456789ab-s",
                "exa-dev-admin-key"):
        assert parse_key(bad) is None


@pytest.mark.parametrize(("prompt", "completion", "price", "expected"), [
    (1_000_000, 0, Price(150_000, 600_000), 150_000),   # 0.15 USD per Mtok
    (1, 0, Price(150_000, 600_000), 1),                 # 0.15 micro-USD rounds up to 1
    (0, 0, Price(150_000, 600_000), 0),
    (10, 3, Price(1_000_000, 2_000_000), 16),
    (10, 3, None, 0),                                   # unpriced: cost 0, the record says priced=0
])
def test_cost_is_exact_integer_micro_usd_rounded_up(prompt: int, completion: int, price: Price | None,
                                                    expected: int) -> None:
    assert cost_micro_usd(prompt, completion, price) == expected


def test_prompt_bound_covers_text_and_counts_media_parts() -> None:
    text = "héllo wörld " * 50
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    req = ChatCompletionRequest.model_validate_json(raw)
    bound = estimate_prompt_tokens(raw, req.messages, overhead=64, media_tokens=1000)
    assert bound >= len(text.encode()) + 64  # one token per byte at most, plus the template
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 100_000}}
    parts = [{"type": "text", "text": "hi"}, image]
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]})
    req = ChatCompletionRequest.model_validate_json(raw)
    bound = estimate_prompt_tokens(raw, req.messages, overhead=64, media_tokens=1000)
    assert 1000 + 64 < bound < 1000 + 64 + 200  # the base64 bytes are not tokens; the image counts 1000


def test_output_limit_is_the_field_vllm_obeys_per_api_and_rewrite() -> None:
    chat = ChatCompletionRequest.model_validate_json(
        b'{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":50,"max_completion_tokens":20}')
    assert (chat.output_limit, chat.output_limit_sent) == (20, True)  # max_completion_tokens wins, as in vLLM
    body = orjson.loads(with_max_tokens(b'{"model":"m","max_tokens":50,"max_completion_tokens":20}', 7))
    assert body["max_tokens"] == body["max_completion_tokens"] == 7
    bare = ChatCompletionRequest.model_validate_json(b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    assert (bare.output_limit, bare.output_limit_sent) == (0, False)
    comp = CompletionRequest.model_validate_json(b'{"model":"m","prompt":"x"}')
    assert (comp.output_limit, comp.output_limit_sent) == (16, False)  # vLLM's completions default
    comp = CompletionRequest.model_validate_json(b'{"model":"m","prompt":"x","max_completion_tokens":1,"max_tokens":9}')
    assert comp.output_limit == 9  # completions have no max_completion_tokens: vLLM ignores it
    assert orjson.loads(with_max_tokens(b'{"model":"m","prompt":"x"}', 9)) == {"model": "m", "prompt": "x",
                                                                               "max_tokens": 9}
