"""The generation span on real SmolLM2, as an OTLP collector receives it.

One CPU vLLM with ngram speculative decoding serves two endpoints: `span-smol`, whose engine block
does not enable speculative decoding (its spans carry no spec-decode attributes), and `span-spec`,
whose block does. The stack exports to a real OTLP/HTTP receiver decoding the protobuf; calls go
through the gateway with a budgeted virtual key and the official openai client.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as ep_pb
from examlops.engine_proxy.v1 import engine_proxy_pb2_grpc as ep_grpc
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until
from examlops_testsupport.governance import ADMIN, cost_records
from examlops_testsupport.otlp import OtlpReceiver, ReceivedSpan
from examlops_testsupport.plugin import VllmServer
from examlops_testsupport.vllm import NGRAM_SPEC, smol_block

pytestmark = pytest.mark.vllm

SPEC = NGRAM_SPEC
PROJECT = "spans"
#: a prompt whose answer repeats its own words: ngram drafts find matches in it
REPEAT = "Repeat these words exactly, five times: red green blue red green blue red green blue"
SPEC_ATTRIBUTES = ("examlops.specdecode.acceptance_rate", "examlops.specdecode.speedup")
REQUEST_ATTRIBUTES = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                      "gen_ai.response.model", "gen_ai.request.max_tokens", "gen_ai.request.temperature",
                      "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons",
                      "server.address", "examlops.endpoint", "examlops.replica", "examlops.project",
                      "examlops.virtual_key.id", "examlops.cost.usd", "examlops.ttft_ms", "examlops.cache",
                      "examlops.guardrails")


def _block(**extra: Any) -> str:
    data = smol_block().model_dump(mode="json", exclude_none=True)
    data.pop("base_url", None)
    data.update(extra)
    return json.dumps(data)


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    with OtlpReceiver("http/protobuf") as receiver:
        yield receiver


@pytest.fixture(scope="module")
def vllm_url(smol_spec_vllm: VllmServer) -> str:
    """The session's SmolLM2 with ngram speculative decoding (and prefix caching)."""
    return smol_spec_vllm.base_url


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, otlp: OtlpReceiver,
           vllm_url: str) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("traced"), redis_server,
                       {"EXAMLOPS_PRICE_REFRESH_S": "0.2", **otlp.env()}) as stack:
        stack.register("span-smol", engine="vllm-server", base_url=vllm_url, served_model_name="smol",
                       engine_block_json=_block(), project=PROJECT)
        stack.register("span-spec", engine="vllm-server", base_url=vllm_url, served_model_name="smol",
                       engine_block_json=_block(speculative_decoding=SPEC), project=PROJECT)
        for model in ("span-smol", "span-spec"):
            out = stack.cli("gateway", "price", "set", model, "--input-per-mtok", "3", "--output-per-mtok", "7")
            assert out.returncode == 0, out.stderr
        wait_until(lambda: {"span-smol", "span-spec"} <= _priced(stack), 15, what="routes and prices")
        yield stack


def _priced(stack: Stack) -> set[str]:
    routed = {m["id"] for m in httpx.get(stack.gateway_url + "/v1/models", headers=ADMIN).json()["data"]}
    priced = {p["model"] for p in httpx.get(stack.gateway_url + "/admin/prices", headers=ADMIN).json()["data"]}
    return routed & priced


def _key(stack: Stack) -> tuple[str, openai.OpenAI]:
    out = stack.cli("--json", "gateway", "key", "issue", "--tenant", "t", "--project", PROJECT, "--model", "span-smol",
                    "--model", "span-spec", "--budget", "5")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    return str(row["id"]), openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=row["virtual_key"],
                                         max_retries=0)


def _generation_span(otlp: OtlpReceiver, key_id: str, name: str, count: int = 1) -> ReceivedSpan:
    """The `count`-th generation span of `key_id` named `name`, once it is exported."""
    def mine(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.name == name and s.attributes.get("examlops.virtual_key.id") == key_id]
    return mine(otlp.wait_for(lambda spans: len(mine(spans)) >= count))[count - 1]


def _cost(stack: Stack, key_id: str, count: int = 1) -> dict[str, str]:
    wait_until(lambda: len(cost_records(stack, key_id)) >= count, 10, what="the cost record")
    return cost_records(stack, key_id)[count - 1]


def _descends(span: ReceivedSpan, ancestor: ReceivedSpan, spans: list[ReceivedSpan]) -> bool:
    by_id = {s.span_id: s for s in spans if s.trace_id == ancestor.trace_id}
    parent = span.parent_span_id
    while parent:
        if parent == ancestor.span_id:
            return True
        parent = by_id[parent].parent_span_id if parent in by_id else ""
    return False


def _engine_proxy_child(otlp: OtlpReceiver, span: ReceivedSpan) -> ReceivedSpan:
    """engine-proxy's span of the call, in the generation span's trace and below it."""
    def found(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.service == "engine-proxy" and s.trace_id == span.trace_id
                and _descends(s, span, spans)]
    return found(otlp.wait_for(lambda spans: bool(found(spans))))[0]


def _check_common(span: ReceivedSpan, key_id: str, endpoint: str, cost: dict[str, str]) -> dict[str, Any]:
    a = span.attributes
    missing = [name for name in REQUEST_ATTRIBUTES if name not in a]
    assert not missing, (missing, a)
    assert span.service == "gateway" and span.kind == "CLIENT" and span.status == "UNSET", span
    assert a["gen_ai.operation.name"] == "chat" and span.name == f"chat {endpoint}"
    assert a["gen_ai.provider.name"] == "vllm" and a["gen_ai.request.model"] == endpoint == a["examlops.endpoint"]
    assert a["examlops.project"] == PROJECT and a["examlops.virtual_key.id"] == key_id
    assert a["examlops.replica"] == "r0" and a["server.address"] == "127.0.0.1"
    assert a["examlops.cost.usd"] == int(cost["cost_micro_usd"]) / 1_000_000 > 0
    assert a["gen_ai.usage.input_tokens"] == int(cost["prompt_tokens"])
    assert a["gen_ai.usage.output_tokens"] == int(cost["completion_tokens"])
    assert a["examlops.ttft_ms"] > 0 and a["examlops.cache"] == "" and a["examlops.guardrails"] == ""
    return a


def test_whole_answer_span_has_the_engine_counts_and_the_recorded_cost(traced: Stack, otlp: OtlpReceiver) -> None:
    key_id, client = _key(traced)
    resp = client.chat.completions.create(model="span-smol", max_tokens=12, temperature=0.5,
                                          messages=[{"role": "user", "content": "Say hello."}])
    assert resp.usage is not None
    span = _generation_span(otlp, key_id, "chat span-smol")
    a = _check_common(span, key_id, "span-smol", _cost(traced, key_id))
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        resp.usage.prompt_tokens, resp.usage.completion_tokens)
    assert a["gen_ai.response.finish_reasons"] == [resp.choices[0].finish_reason]
    assert a["gen_ai.response.model"] == resp.model
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.temperature"] == 0.5
    assert not set(SPEC_ATTRIBUTES) & set(a), a  # the block does not enable speculative decoding
    assert _engine_proxy_child(otlp, span).trace_id == span.trace_id


def test_streamed_span_ends_with_the_stream_and_carries_spec_decode(traced: Stack, otlp: OtlpReceiver) -> None:
    key_id, client = _key(traced)
    stream = client.chat.completions.create(model="span-spec", max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": REPEAT}])
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    span = _generation_span(otlp, key_id, "chat span-spec")
    a = _check_common(span, key_id, "span-spec", _cost(traced, key_id))
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens)
    assert a["gen_ai.response.finish_reasons"] == finish and a["gen_ai.response.model"] == chunks[0].model
    assert 0 <= a["examlops.specdecode.acceptance_rate"] <= 1, a
    assert a["examlops.specdecode.speedup"] >= 1, a
    assert _engine_proxy_child(otlp, span).trace_id == span.trace_id


def _spec_counters(vllm_url: str) -> tuple[float, float, float]:
    page = httpx.get(vllm_url + "/metrics").text

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                   if line.startswith((name + "{", name + " ")))
    return (total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_draft_tokens_total"),
            total("vllm:spec_decode_num_accepted_tokens_total"))


def test_engine_proxy_names_the_replica_and_measures_the_call_from_vllm_counters(traced: Stack,
                                                                                  vllm_url: str) -> None:
    stub = ep_grpc.EngineProxyStub(traced.channel("engine-proxy"))
    body = json.dumps({"model": "span-spec", "max_tokens": 40, "temperature": 0,
                       "messages": [{"role": "user", "content": REPEAT}]}).encode()
    # a first call opens the pool (its replica is scraped from then on); the second is measured alone
    list(stub.Generate(ep_pb.GenerateRequest(endpoint="span-spec", kind=ep_pb.REQUEST_KIND_CHAT, body_json=body),
                       timeout=120))
    before = _spec_counters(vllm_url)
    chunks = list(stub.Generate(ep_pb.GenerateRequest(endpoint="span-spec", kind=ep_pb.REQUEST_KIND_CHAT,
                                                      body_json=body), timeout=120))
    after = _spec_counters(vllm_url)
    assert chunks[0].replica == "r0" and chunks[-1].final and chunks[-1].HasField("spec_decode")
    spec = chunks[-1].spec_decode
    drafts, draft_tokens, accepted = (b - a for a, b in zip(before, after, strict=True))
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (drafts, draft_tokens, accepted)
    assert draft_tokens > 0, "ngram proposed nothing for a prompt that repeats itself"
    assert spec.acceptance_rate == pytest.approx(accepted / draft_tokens)
    assert spec.speedup == pytest.approx(1 + accepted / drafts)

    plain = list(stub.Generate(ep_pb.GenerateRequest(endpoint="span-smol", kind=ep_pb.REQUEST_KIND_CHAT,
                                                     body_json=body.replace(b"span-spec", b"span-smol")),
                               timeout=120))
    assert plain[0].replica == "r0" and not plain[-1].HasField("spec_decode")


def test_an_engine_refusal_sets_the_span_status_with_the_openai_code(traced: Stack, otlp: OtlpReceiver) -> None:
    key_id, client = _key(traced)
    with pytest.raises(openai.BadRequestError) as info:  # beyond the server's 2048-token context
        client.chat.completions.create(model="span-smol", max_tokens=100_000,
                                       messages=[{"role": "user", "content": "Say hello."}])
    body = info.value.body
    assert isinstance(body, dict)
    span = _generation_span(otlp, key_id, "chat span-smol")
    assert span.status == "ERROR" and span.attributes["error.type"] == body["code"] == "engine_rejected", span
    assert span.attributes["examlops.cost.usd"] == 0 and _cost(traced, key_id)["status"] == "400"

