"""POST /v1/embeddings through the gateway, driven by the official openai client against real services
and a real Redis: echo's deterministic vectors for the shapes, refusals and governance; the real
all-MiniLM-L6-v2 on CPU vLLM for the answer itself (marked vllm)."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest
import redis

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.guardrails import ADMIN, client
from examlops_testsupport.plugin import VllmServer
from examlops_testsupport.vllm import minilm_block

EMBED = "emb-echo"          # an echo route whose engine block says task: embed
EMBED_OTHER = "emb-echo-2"  # another one, for the allow-list
CHAT = "emb-chat"           # an echo route that generates
PROJECT = "embproj"


def _models(stack: Stack, key: str = DEFAULT_ADMIN_KEY) -> dict[str, dict[str, Any]]:
    resp = httpx.get(stack.gateway_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return {m["id"]: m for m in resp.json().get("data", [])}


def _register_embed(stack: Stack, name: str, **fields: Any) -> None:
    block = fields.pop("block", {"engine": "echo", "task": "embed"})
    stack.register(name, engine=block["engine"], engine_block_json=json.dumps(block), project=PROJECT, **fields)


@pytest.fixture(scope="module")
def admin(stack: Stack) -> Iterator[openai.OpenAI]:
    _register_embed(stack, EMBED)
    _register_embed(stack, EMBED_OTHER)
    stack.register(CHAT, engine="echo", project=PROJECT)
    wait_until(lambda: {EMBED, EMBED_OTHER, CHAT} <= set(_models(stack)), 10)
    c = client(stack, DEFAULT_ADMIN_KEY)
    yield c
    c.close()


def code_of(exc: openai.APIStatusError) -> str:
    assert isinstance(exc.body, dict), exc.body
    return str(exc.body["code"])


def _floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


# --- the answer ------------------------------------------------------------------------------------

def test_float_and_base64_carry_the_same_vector(admin: openai.OpenAI) -> None:
    plain = admin.embeddings.create(model=EMBED, input="hello big world", encoding_format="float")
    vector = plain.data[0].embedding
    assert len(vector) == 384 and abs(math.fsum(v * v for v in vector) - 1) < 1e-5
    assert plain.model == EMBED and plain.usage.prompt_tokens == 3 and plain.usage.total_tokens == 3

    # the openai client asks for base64 by default and decodes it itself
    assert admin.embeddings.create(model=EMBED, input="hello big world").data[0].embedding == vector
    raw = admin.embeddings.create(model=EMBED, input="hello big world", encoding_format="base64")
    assert isinstance(raw.data[0].embedding, str) and _floats(raw.data[0].embedding) == vector


def test_batches_of_strings_and_token_arrays_keep_their_order(admin: openai.OpenAI) -> None:
    texts = ["first text", "second one here", "third"]
    batch = admin.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for text, item in zip(texts, batch.data, strict=True):
        alone = admin.embeddings.create(model=EMBED, input=text, encoding_format="float").data[0].embedding
        assert item.embedding == alone
    assert batch.usage.prompt_tokens == 6

    tokens = admin.embeddings.create(model=EMBED, input=[[1, 2, 3], [4, 5]], encoding_format="float")
    assert len(tokens.data) == 2 and tokens.usage.prompt_tokens == 5
    one = admin.embeddings.create(model=EMBED, input=[4, 5], encoding_format="float")
    assert one.data[0].embedding == tokens.data[1].embedding != tokens.data[0].embedding


def test_dimensions_and_forwarded_fields_reach_the_engine(stack: Stack, admin: openai.OpenAI) -> None:
    assert len(admin.embeddings.create(model=EMBED, input="x y", dimensions=64).data[0].embedding) == 64
    key = _issue(stack, "--model", EMBED)["virtual_key"]
    c = client(stack, key)
    resp = c.embeddings.create(model=EMBED, input="x y", dimensions=8, user="u-1",
                               extra_body={"truncate_prompt_tokens": 16})
    assert len(resp.data[0].embedding) == 8


def test_models_show_each_routes_task(stack: Stack, admin: openai.OpenAI) -> None:
    models = _models(stack)
    assert models[EMBED]["task"] == "embed" and models[CHAT]["task"] == "generate"
    assert {m.id: m.model_extra.get("task") for m in admin.models.list() if m.model_extra}[EMBED] == "embed"


# --- refusals, in OpenAI's error shape -------------------------------------------------------------

def test_unknown_model_is_404(admin: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        admin.embeddings.create(model="no-such-embedder", input="x")
    assert code_of(info.value) == "model_not_found" and info.value.body["param"] == "model"  # type: ignore[index]


def test_tasks_do_not_cross(admin: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as on_embed:
        admin.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert code_of(on_embed.value) == "model_task_mismatch" and EMBED in str(on_embed.value)
    assert "/v1/embeddings" in str(on_embed.value)
    with pytest.raises(openai.BadRequestError) as completion:
        admin.completions.create(model=EMBED, prompt="hi")
    assert code_of(completion.value) == "model_task_mismatch"
    with pytest.raises(openai.BadRequestError) as on_chat:
        admin.embeddings.create(model=CHAT, input="hi")
    assert code_of(on_chat.value) == "model_task_mismatch" and CHAT in str(on_chat.value)
    assert "task: embed" in str(on_chat.value)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ["x"] * 2049}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [1, -2]}, "input"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({}, "input"),
])
def test_bad_requests_are_400_naming_the_field(stack: Stack, admin: openai.OpenAI, body: dict[str, Any],
                                               param: str) -> None:
    resp = httpx.post(stack.gateway_url + "/v1/embeddings", headers=ADMIN, json={"model": EMBED, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_unknown_field_is_refused_for_virtual_keys_only(stack: Stack, admin: openai.OpenAI) -> None:
    key = _issue(stack, "--model", EMBED)["virtual_key"]
    with pytest.raises(openai.BadRequestError) as info:
        client(stack, key).embeddings.create(model=EMBED, input="x", extra_body={"priority": 5})
    assert code_of(info.value) == "unsupported_field" and info.value.body["param"] == "priority"  # type: ignore[index]


def test_no_key_is_401(stack: Stack, admin: openai.OpenAI) -> None:
    resp = httpx.post(stack.gateway_url + "/v1/embeddings", json={"model": EMBED, "input": "x"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(stack, "sk-exa-0123456789ab-nope").embeddings.create(model=EMBED, input="x")


# --- governance: the same keys, allow-lists, budgets and limits as chat, at the input price ----------

def _issue(stack: Stack, *args: str) -> dict[str, Any]:
    out = stack.cli("--json", "gateway", "key", "issue", "--tenant", "emb", "--project", PROJECT, *args)
    assert out.returncode == 0, out.stderr
    row: dict[str, Any] = json.loads(out.stdout)
    return row


def _price(stack: Stack, model: str, input_usd: float, output_usd: float) -> None:
    out = stack.cli("gateway", "price", "set", model, "--input-per-mtok", str(input_usd),
                    "--output-per-mtok", str(output_usd))
    assert out.returncode == 0, out.stderr
    wait_until(lambda: any(p["model"] == model and p["input_per_mtok"] == input_usd for p in httpx.get(
        stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]), 10)


def _records(stack: Stack, key_id: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The key's record once its calls are settled, and its cost records (oldest first)."""
    r = redis.Redis(port=stack.ports.redis, decode_responses=True)
    try:
        wait_until(lambda: not [f for f in cast(list[str], r.hkeys("{vk:" + key_id + "}:res"))
                                if not f.startswith("reaped:")], 5)
        key = cast(dict[str, str], r.hgetall("{vk:" + key_id + "}:key"))
        stream = cast(list[tuple[str, dict[str, str]]], r.xrange("{vk:" + key_id + "}:cost"))
        return key, [fields for _, fields in stream]
    finally:
        r.close()


def test_budgeted_key_pays_the_input_price_only(stack: Stack, admin: openai.OpenAI) -> None:
    _price(stack, EMBED, 1, 1000)  # 1 micro-USD per input token; an output token would cost 1000
    row = _issue(stack, "--model", EMBED, "--budget", "0.01", "--tpm", "100000")
    c = client(stack, row["virtual_key"])
    first = c.embeddings.create(model=EMBED, input="one two three four", encoding_format="float")
    second = c.embeddings.create(model=EMBED, input=["five six", "seven"], encoding_format="float")
    key, records = _records(stack, row["id"])
    assert [(r["model"], r["status"], r["prompt_tokens"], r["completion_tokens"], r["cost_micro_usd"])
            for r in records] == [(EMBED, "200", "4", "0", "4"), (EMBED, "200", "3", "0", "3")]
    assert first.usage.prompt_tokens == 4 and second.usage.prompt_tokens == 3
    assert all(r["estimated"] == "0" and r["priced"] == "1" for r in records)
    assert (key["spent"], key["reserved"], key["requests"]) == ("7", "0", "2")
    listed = json.loads(stack.cli("--json", "gateway", "key", "list", "--all").stdout)
    assert next(k for k in listed if k["id"] == row["id"])["spend_micro_usd"] == 7


def test_budget_reserves_no_output(stack: Stack, admin: openai.OpenAI) -> None:
    """A budget that pays for the prompt but not for one output token admits an embedding (a chat
    would be refused), and a budget too small for the prompt is 429 budget_exceeded."""
    _price(stack, EMBED, 1, 1000)
    row = _issue(stack, "--model", EMBED, "--budget", "0.0002")  # 200 micro-USD: the prompt bound fits
    c = client(stack, row["virtual_key"])
    assert len(c.embeddings.create(model=EMBED, input="cheap").data) == 1
    poor = _issue(stack, "--model", EMBED, "--budget", "0.00001")  # 10 micro-USD: less than the bound
    with pytest.raises(openai.RateLimitError) as info:
        client(stack, poor["virtual_key"]).embeddings.create(model=EMBED, input="x")
    assert code_of(info.value) == "budget_exceeded"


def test_unpriced_embedding_route_is_refused_for_budgeted_keys(stack: Stack, admin: openai.OpenAI) -> None:
    row = _issue(stack, "--model", EMBED_OTHER, "--budget", "1")
    with pytest.raises(openai.PermissionDeniedError) as info:
        client(stack, row["virtual_key"]).embeddings.create(model=EMBED_OTHER, input="x")
    assert code_of(info.value) == "model_not_priced"


def test_rpm_and_tpm_limits_apply(stack: Stack, admin: openai.OpenAI) -> None:
    c = client(stack, _issue(stack, "--model", EMBED, "--rpm", "2")["virtual_key"])
    c.embeddings.create(model=EMBED, input="one")
    c.embeddings.create(model=EMBED, input="two")
    with pytest.raises(openai.RateLimitError) as info:
        c.embeddings.create(model=EMBED, input="three")
    assert code_of(info.value) == "rate_limit_exceeded" and int(info.value.response.headers["retry-after"]) >= 1
    tiny = client(stack, _issue(stack, "--model", EMBED, "--tpm", "20")["virtual_key"])
    with pytest.raises(openai.RateLimitError) as too_small:  # the prompt bound alone exceeds the bucket
        tiny.embeddings.create(model=EMBED, input="x")
    assert "tokens-per-minute" in str(too_small.value)


def test_allow_list_applies(stack: Stack, admin: openai.OpenAI) -> None:
    row = _issue(stack, "--model", EMBED)
    c = client(stack, row["virtual_key"])
    assert len(c.embeddings.create(model=EMBED, input="mine").data) == 1
    with pytest.raises(openai.PermissionDeniedError) as info:
        c.embeddings.create(model=EMBED_OTHER, input="not mine")
    assert code_of(info.value) == "model_not_allowed"
    assert set(_models(stack, row["virtual_key"])) == {EMBED}


def test_metrics_count_embeddings_like_chat(stack: Stack, admin: openai.OpenAI) -> None:
    row = _issue(stack, "--model", EMBED)
    client(stack, row["virtual_key"]).embeddings.create(model=EMBED, input="count me")
    _records(stack, row["id"])
    metrics = httpx.get(stack.gateway_url + "/metrics").text
    assert f'examlops_gateway_requests_total{{model="{EMBED}",status="200"}}' in metrics
    assert f'examlops_gateway_request_seconds_count{{model="{EMBED}"}}' in metrics
    assert f'examlops_gateway_calls_total{{model="{EMBED}",project="{PROJECT}",status="200"}}' in metrics
    assert f'examlops_gateway_tokens_total{{model="{EMBED}",project="{PROJECT}",type="prompt"}}' in metrics


# --- the real all-MiniLM-L6-v2 on CPU vLLM ----------------------------------------------------------

@pytest.mark.vllm
def test_minilm_through_the_gateway_equals_vllms_own_answer(stack: Stack, admin: openai.OpenAI,
                                                             minilm_vllm: VllmServer) -> None:
    route = "minilm-e2e"
    block = minilm_block().model_dump(mode="json", exclude_none=True) | {"base_url": minilm_vllm.base_url}
    _register_embed(stack, route, block=block, base_url=minilm_vllm.base_url,
                    served_model_name=minilm_vllm.served_model_name)
    wait_until(lambda: route in _models(stack), 10)
    assert _models(stack)[route]["task"] == "embed"

    texts = ["The gateway routes requests to vLLM.", "A cat sleeps on the warm windowsill.",
             "Budgets are reserved before dispatch and settled afterwards."]

    def reference(text: str) -> list[float]:
        resp = httpx.post(minilm_vllm.base_url + "/v1/embeddings", timeout=60,
                          json={"model": minilm_vllm.served_model_name, "input": text})
        assert resp.status_code == 200, resp.text
        vector: list[float] = resp.json()["data"][0]["embedding"]
        return vector

    expected = [reference(t) for t in texts]
    one = admin.embeddings.create(model=route, input=texts[0], encoding_format="float")
    assert len(one.data[0].embedding) == 384 and one.usage.prompt_tokens > 0
    assert cosine(one.data[0].embedding, expected[0]) >= 0.999
    batch = admin.embeddings.create(model=route, input=texts)  # base64, decoded by the client
    assert [d.index for d in batch.data] == [0, 1, 2]
    for item, want in zip(batch.data, expected, strict=True):
        assert cosine(item.embedding, want) >= 0.999
    assert cosine(batch.data[0].embedding, expected[1]) < 0.9  # the order is the inputs' own
    with pytest.raises(openai.BadRequestError):  # vLLM refuses dimensions for a model without matryoshka
        admin.embeddings.create(model=route, input="x", dimensions=64)
