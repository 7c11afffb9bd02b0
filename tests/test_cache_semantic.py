"""The cache shared by gateway processes, and semantic mode on real embeddings: an answer kept through
one gateway is served through another (exact and semantic, within a second), a paraphrase hits and
an unrelated question misses on the real all-MiniLM-L6-v2 (CPU vLLM). Generation is the echo engine,
so the answer a hit returns is recognisably the first question's echo."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from examlops_testsupport.cache import SEMANTIC_PREFIX, ask, cache_cli, issue, last_cost, stored
from examlops_testsupport.fixtures import RedisServer, Stack, wait_until
from examlops_testsupport.guardrails import ADMIN, register_echo
from examlops_testsupport.plugin import VllmServer

MINILM_HF = "sentence-transformers/all-MiniLM-L6-v2"
NO_STORE = {"Cache-Control": "no-store"}  # a probe that looks up and never adds an entry of its own


def _embed_route(stack: Stack, name: str, **fields: object) -> None:
    """Register an embedding route and wait until the gateway routes it as one."""
    fields.setdefault("engine_block_json", json.dumps({"engine": "echo", "task": "embed"}))
    stack.register(name, engine=str(fields.pop("engine", "echo")), **fields)

    def routed() -> bool:
        data = httpx.get(stack.gateway_url + "/v1/models", headers=ADMIN).json()["data"]
        return any(m["id"] == name and m.get("task") == "embed" for m in data)
    wait_until(routed, 10, what=f"the embedding route {name} reaches the gateway")


def _found_through(key: str, model: str, text: str, url: str, outcome: str, within_s: float) -> float:
    """Seconds until `url` answers `text` with `outcome`, probing without storing."""
    start = time.monotonic()
    wait_until(lambda: ask(key, model, text, url, headers=NO_STORE)[1] == outcome, within_s, 0.05,
               what=f"{outcome} through {url}")
    return time.monotonic() - start


def test_two_gateway_processes_share_the_exact_cache_and_the_semantic_index(
        stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "c-two-x", "c-two-s")
    _embed_route(stack, "c-two-embed")
    _, other = stack.start_gateway_replica("gateway-cache-b")
    cache_cli(stack, "set", "--model", "c-two-x", "--mode", "exact", "--scope", "tenant", urls=(other,))
    cache_cli(stack, "set", "--model", "c-two-s", "--mode", "semantic", "--embedding-model", "c-two-embed",
              "--threshold", "0.99", "--scope", "tenant", urls=(other,))
    one, two = issue(stack, "c-two-x", "shared"), issue(stack, "c-two-x", "shared")

    assert ask(one, "c-two-x", "exact across replicas", stack.gateway_url)[1] == "miss"
    took = _found_through(two, "c-two-x", "exact across replicas", other, "hit-exact", 2)
    assert took < 1.0, took

    sem_one, sem_two = issue(stack, "c-two-s", "shared"), issue(stack, "c-two-s", "shared")
    text, header, _ = ask(sem_one, "c-two-s", "semantic across replicas", stack.gateway_url)
    assert (text, header) == ("echo: semantic across replicas", "miss")
    took = _found_through(sem_two, "c-two-s", "semantic across replicas", other, "hit-semantic", 2)
    assert took < 1.0, took  # written through the first gateway, found through the second
    assert ask(sem_two, "c-two-s", "semantic across replicas", other)[0] == "echo: semantic across replicas"
    assert last_cost(redis_server, sem_two)["cache"] == "hit-semantic"
    assert ask(sem_two, "c-two-s", "something else entirely", other, headers=NO_STORE)[1] == "miss"
    outsider = issue(stack, "c-two-s", "other-tenant")
    assert ask(outsider, "c-two-s", "semantic across replicas", other, headers=NO_STORE)[1] == "miss"

    assert stored(redis_server, "c-two-s", SEMANTIC_PREFIX) == 1
    flushed = cache_cli(stack, "flush", "--model", "c-two-s")
    assert flushed["deleted"] == 1 and flushed["index_entries"] == 1, flushed
    assert ask(sem_two, "c-two-s", "semantic across replicas", other, headers=NO_STORE)[1] == "miss"


def test_an_embedding_route_that_fails_leaves_the_call_uncached(stack: Stack) -> None:
    register_echo(stack, "c-sem-down")
    _embed_route(stack, "c-down-embed", engine="vllm-server", base_url="http://127.0.0.1:9",
                 engine_block_json=json.dumps({"engine": "vllm-server", "task": "embed", "hf_model_id": MINILM_HF}))
    cache_cli(stack, "set", "--model", "c-sem-down", "--mode", "semantic", "--embedding-model", "c-down-embed")
    key = issue(stack, "c-sem-down")
    assert ask(key, "c-sem-down", "still answered", stack.gateway_url)[:2] == ("echo: still answered", "bypass")


@pytest.mark.vllm
def test_a_paraphrase_hits_and_an_unrelated_question_misses_on_real_minilm(
        stack: Stack, redis_server: RedisServer, minilm_vllm: VllmServer) -> None:
    block = json.dumps({"engine": "vllm-server", "task": "embed", "served_model_name": "minilm",
                        "hf_model_id": MINILM_HF})
    _embed_route(stack, "minilm", engine="vllm-server", base_url=minilm_vllm.base_url,
                 served_model_name=minilm_vllm.served_model_name, engine_block_json=block)
    register_echo(stack, "c-sem")
    cache_cli(stack, "set", "--model", "c-sem", "--mode", "semantic")  # minilm and 0.95: the defaults
    key, url = issue(stack, "c-sem"), stack.gateway_url
    first = "How do I reset my password?"
    assert ask(key, "c-sem", first, url)[:2] == (f"echo: {first}", "miss")
    wait_until(lambda: stored(redis_server, "c-sem", SEMANTIC_PREFIX) == 1, 5, what="the answer is kept")
    text, header, _ = ask(key, "c-sem", "How can I reset my password?", url, headers=NO_STORE)
    assert (text, header) == (f"echo: {first}", "hit-semantic")  # cosine ~0.99: the first question's answer
    text, header, _ = ask(key, "c-sem", "What is the boiling point of water at sea level?", url, headers=NO_STORE)
    assert (text, header) == ("echo: What is the boiling point of water at sea level?", "miss")  # cosine ~0.13
    looser = "I forgot my password, how do I change it?"  # cosine ~0.90 with the first question
    assert ask(key, "c-sem", looser, url, headers=NO_STORE)[1] == "miss"
    cache_cli(stack, "set", "--model", "c-sem", "--mode", "semantic", "--threshold", "0.85")
    assert ask(key, "c-sem", looser, url, headers=NO_STORE)[:2] == (f"echo: {first}", "hit-semantic")
    system = [{"role": "system", "content": "Answer in French."}]
    other = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}", **NO_STORE},
                       json={"model": "c-sem", "temperature": 0,
                             "messages": [*system, {"role": "user", "content": "How can I reset my password?"}]})
    assert other.headers["x-examlops-cache"] == "miss"  # another system prompt is another space
