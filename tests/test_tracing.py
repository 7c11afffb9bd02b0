"""Tracing end to end: the services export to a real OTLP receiver (HTTP/protobuf and gRPC), one trace
spans gateway → engine-proxy → mediaguard and reaches the engine as `traceparent`; with no OTEL
variables (or OTEL_SDK_DISABLED) nothing is exported or propagated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.cache import cache_cli
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until
from examlops_testsupport.media_corpus import POLICY_KWARGS, image, request
from examlops_testsupport.otlp import OtlpReceiver, ReceivedSpan
from examlops_testsupport.recorder import RecordingServer

ECHO = "trace-echo"
GENERATE = "examlops.engine_proxy.v1.EngineProxy/Generate"          # a stream
GENERATE_ONCE = "examlops.engine_proxy.v1.EngineProxy/GenerateOnce"  # a whole answer
VALIDATE = "examlops.mediaguard.v1.MediaGuard/Validate"
CHAT = "POST /v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module", params=["http/protobuf", "grpc"])
def traced(request: pytest.FixtureRequest, redis_server: RedisServer,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, OtlpReceiver, openai.OpenAI]]:
    """The five services exporting to an OTLP receiver of the parametrised protocol."""
    with OtlpReceiver(request.param) as otlp, running_stack(
            tmp_path_factory.mktemp("traced"), redis_server, otlp.env()) as stack:
        block = {"engine": "echo", "multimodal": POLICY_KWARGS}
        stack.register(ECHO, engine="echo", engine_block_json=json.dumps(block))
        client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        wait_until(lambda: _answers(client, ECHO), 10, what=f"{ECHO} routable")
        yield stack, otlp, client
        client.close()


def _answers(client: openai.OpenAI, model: str) -> bool:
    try:
        client.chat.completions.create(model=model, messages=HELLO)  # type: ignore[arg-type]
        return True
    except openai.NotFoundError:
        return False


def _trace_of(otlp: OtlpReceiver, span: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.span_id: s for s in otlp.spans(trace_id=span.trace_id)}


def _call_trace(otlp: OtlpReceiver, client: openai.OpenAI, *names: str, **create: object) -> dict[str, ReceivedSpan]:
    """Make one call with a traceparent of our own, and return its trace once `names` have arrived."""
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    client.chat.completions.create(model=ECHO, extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                                   **create)  # type: ignore[call-overload]

    def arrived(spans: list[ReceivedSpan]) -> bool:
        """`names` are in, and so is every span's parent: services export in batches, and the gateway's
        generation span (the parent of engine-proxy's) ends after the HTTP response, at the settle."""
        mine = {s.span_id: s for s in spans if s.trace_id == trace_id}
        return all(any(s.name == n for s in mine.values()) for n in names) and all(
            s.parent_span_id in mine or s.parent_span_id == parent for s in mine.values())

    otlp.wait_for(arrived)
    spans = {s.span_id: s for s in otlp.spans(trace_id=trace_id)}
    root = [s for s in spans.values() if s.parent_span_id not in spans]
    assert [(s.service, s.name, s.parent_span_id) for s in root] == [("gateway", CHAT, parent)]
    return spans


def _one(spans: dict[str, ReceivedSpan], name: str) -> ReceivedSpan:
    (span,) = [s for s in spans.values() if s.name == name]
    return span


def _ancestors(spans: dict[str, ReceivedSpan], span: ReceivedSpan) -> list[str]:
    """The services of `span`'s ancestors, nearest first."""
    out = []
    while span.parent_span_id in spans:
        span = spans[span.parent_span_id]
        out.append(span.service)
    return out


def test_one_call_is_one_trace_from_the_gateway_to_engine_proxy(
        traced: tuple[Stack, OtlpReceiver, openai.OpenAI]) -> None:
    _, otlp, client = traced
    spans = _call_trace(otlp, client, CHAT, GENERATE_ONCE, messages=HELLO)
    gateway, generate = _one(spans, CHAT), _one(spans, GENERATE_ONCE)
    assert gateway.kind == generate.kind == "SERVER"
    assert gateway.service == "gateway" and generate.service == "engine-proxy"
    assert gateway.attributes["http.response.status_code"] == 200
    assert generate.attributes["rpc.method"] == "GenerateOnce"
    assert set(_ancestors(spans, generate)) == {"gateway"}  # engine-proxy's span hangs under the gateway's
    # engine-proxy's handler may close its span just after the gateway has answered: only starts are ordered
    assert gateway.start_ns <= generate.start_ns <= gateway.end_ns
    assert {s.service for s in spans.values()} == {"gateway", "engine-proxy"}  # no media, no mediaguard


def test_a_streamed_call_ends_its_spans_with_the_stream(traced: tuple[Stack, OtlpReceiver, openai.OpenAI]) -> None:
    _, otlp, client = traced
    spans = _call_trace(otlp, client, CHAT, GENERATE, messages=HELLO, stream=True)
    gateway, generate, generation = _one(spans, CHAT), _one(spans, GENERATE), _one(spans, f"chat {ECHO}")
    assert set(_ancestors(spans, generate)) == {"gateway"}
    # The gateway's span lasts as long as the stream: the generation span, in the same process, is
    # stamped when the engine's last message came in. Across processes only starts are ordered
    # (engine-proxy's handler returns after its last message, however late it is scheduled).
    assert generate.start_ns < gateway.end_ns and generation.end_ns <= gateway.end_ns


def test_a_media_call_adds_mediaguards_span_to_the_trace(traced: tuple[Stack, OtlpReceiver, openai.OpenAI]) -> None:
    _, otlp, client = traced
    spans = _call_trace(otlp, client, CHAT, GENERATE_ONCE, VALIDATE,
                        messages=request(image("http://example.com/cat.png")))
    validate = _one(spans, VALIDATE)
    assert validate.service == "mediaguard" and validate.kind == "SERVER"
    assert _ancestors(spans, validate)[0] == "engine-proxy" and "gateway" in _ancestors(spans, validate)


def test_a_cache_hit_has_its_generation_span_saying_which_hit(
        traced: tuple[Stack, OtlpReceiver, openai.OpenAI]) -> None:
    stack, otlp, client = traced
    cache_cli(stack, "set", "--model", ECHO, "--mode", "exact")
    try:
        question = [{"role": "user", "content": f"cache me {os.urandom(4).hex()}"}]
        first = _call_trace(otlp, client, CHAT, GENERATE_ONCE, messages=question, temperature=0)
        hit = _call_trace(otlp, client, CHAT, f"chat {ECHO}", messages=question, temperature=0)
    finally:
        cache_cli(stack, "unset", "--model", ECHO)
    generation = _one(first, f"chat {ECHO}")
    assert generation.attributes["examlops.cache"] == "miss" and generation.kind == "CLIENT"
    cached = _one(hit, f"chat {ECHO}")
    assert GENERATE_ONCE not in {s.name for s in hit.values()}, "a hit called the engine"
    assert cached.attributes["examlops.cache"] == "hit-exact"
    assert cached.attributes["examlops.cost.usd"] == 0.0
    assert "gen_ai.usage.output_tokens" not in cached.attributes  # no engine ran
    assert cached.attributes["gen_ai.response.finish_reasons"] == generation.attributes[
        "gen_ai.response.finish_reasons"]


def test_the_engine_gets_the_traceparent_of_the_call(traced: tuple[Stack, OtlpReceiver, openai.OpenAI]) -> None:
    stack, otlp, client = traced
    server = RecordingServer()
    try:
        stack.register("trace-rec", engine="vllm-server", base_url=server.url,
                       engine_block_json=json.dumps({"engine": "vllm", "hf_model_id": "org/m"}))
        wait_until(lambda: _answers(client, "trace-rec"), 10, what="trace-rec routable")
        server.request_headers.clear()
        trace_id = os.urandom(16).hex()
        client.chat.completions.create(model="trace-rec", messages=HELLO,  # type: ignore[arg-type]
                                       extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
        (headers,) = server.request_headers
        version, sent_trace, sent_parent, flags = headers["traceparent"].split("-")
        assert (version, sent_trace, flags) == ("00", trace_id, "01")
        otlp.wait_for(lambda spans: any(s.span_id == sent_parent for s in spans))
        (parent,) = otlp.spans(trace_id=trace_id, service="engine-proxy")
        assert parent.span_id == sent_parent  # vLLM's spans would hang under engine-proxy's GenerateOnce
    finally:
        server.close()


def test_a_gateway_with_the_sdk_disabled_exports_and_propagates_nothing(
        traced: tuple[Stack, OtlpReceiver, openai.OpenAI]) -> None:
    stack, otlp, _ = traced
    proc, url = stack.start_gateway_replica("gateway-untraced", {
        "OTEL_SDK_DISABLED": "true", "OTEL_SERVICE_NAME": "gateway-untraced"})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        trace_id = os.urandom(16).hex()
        client.chat.completions.create(model=ECHO, messages=HELLO,  # type: ignore[arg-type]
                                       extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
        # engine-proxy still traces: its span of this call is a root of a new trace (no traceparent came).
        roots = lambda spans: [s for s in spans if s.name == GENERATE_ONCE and not s.parent_span_id]  # noqa: E731
        before = len(roots(otlp.spans()))
        client.chat.completions.create(model=ECHO, messages=HELLO)  # type: ignore[arg-type]
        otlp.wait_for(lambda spans: len(roots(spans)) > before)
        assert not otlp.spans(service="gateway-untraced") and not otlp.spans(trace_id=trace_id)
        assert "tracing off (OTEL_SDK_DISABLED=true)" in Path(proc.log_path).read_text()
    finally:
        stack.stop("gateway-untraced")


def test_services_without_otel_variables_install_no_sdk(stack: Stack) -> None:
    """The session stack runs with no OTEL_* variable: every service says tracing is off."""
    for name in ("gateway", "registry", "launcher", "mediaguard", "engine-proxy"):
        log = Path(stack.procs[name].log_path).read_text()
        assert "tracing off (set OTEL_EXPORTER_OTLP_ENDPOINT" in log, name


SETUP = """
import sys
from opentelemetry import trace
from examlops.svc import setup_tracing, shutdown_tracing
on = setup_tracing("svc-default")
with trace.get_tracer("t").start_as_current_span("probe"):
    pass
shutdown_tracing()
print(on, type(trace.get_tracer_provider()).__name__, "opentelemetry.sdk.trace" in sys.modules)
"""


def _setup_in_a_process(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", SETUP], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def test_setup_tracing_installs_nothing_without_an_endpoint() -> None:
    assert _setup_in_a_process({}) == "False ProxyTracerProvider False"
    assert _setup_in_a_process({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"}) \
        == "False ProxyTracerProvider False"


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_setup_tracing_follows_the_standard_variables(protocol: str) -> None:
    with OtlpReceiver(protocol) as otlp:
        env = otlp.env(OTEL_EXPORTER_OTLP_HEADERS="x-tenant=acme",
                       OTEL_RESOURCE_ATTRIBUTES="deployment.environment.name=test")
        assert _setup_in_a_process(env) == "True TracerProvider True"
        span = otlp.wait_for_span("probe")
        assert span.service == "svc-default" and span.resource["deployment.environment.name"] == "test"
        assert otlp.headers[-1]["x-tenant"] == "acme"
        otlp.clear()
        _setup_in_a_process({**env, "OTEL_SERVICE_NAME": "renamed"})
        assert otlp.wait_for_span("probe").service == "renamed"
        otlp.clear()
        _setup_in_a_process({**env, "OTEL_TRACES_SAMPLER": "always_off"})
        assert otlp.spans() == []  # the run flushed on shutdown: a sampled span would be here


def test_an_unknown_protocol_fails_naming_the_variable() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", SETUP], capture_output=True, text=True, timeout=60, env={
        **clean, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert done.returncode != 0 and "OTEL_EXPORTER_OTLP_PROTOCOL='http/json'" in done.stderr


def test_the_start_up_line_never_shows_an_endpoint_password() -> None:
    from examlops.svc import tracing_config

    line = tracing_config({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel:s3cret-pw@collector:4318"}).describe()
    assert "s3cret-pw" not in line and "collector:4318" in line
