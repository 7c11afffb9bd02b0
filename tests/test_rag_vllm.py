"""`exa rag` on real parts: the repository's own docs embedded by the real MiniLM, answered by real
SmolLM2, both through the gateway (one vLLM start per fixture, one after the other on 2 cores)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from examlops_testsupport import REPO_ROOT
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.plugin import VllmServer
from examlops_testsupport.vllm import smol_server

pytestmark = pytest.mark.vllm

DOCS = {"MODEL-VERSIONS.md": "docs/MODEL-VERSIONS.md", "GOVERNANCE.md": "services/gateway/GOVERNANCE.md",
        "GUARDRAILS.md": "services/gateway/GUARDRAILS.md", "LAUNCHER.md": "services/launcher/README.md"}


@pytest.fixture(scope="module")
def smol_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with smol_server(tmp_path_factory.mktemp("vllm-rag")) as url:
        yield url


@pytest.fixture(scope="module")
def routes(stack: Stack, minilm_vllm: VllmServer, smol_url: str) -> None:
    """`minilm`: the real embedding model; `default`: real SmolLM2, as `make up` registers them."""
    block = json.dumps({"engine": "vllm-server", "task": "embed", "served_model_name": "minilm",
                        "hf_model_id": "sentence-transformers/all-MiniLM-L6-v2"})
    stack.register("minilm", engine="vllm-server", base_url=minilm_vllm.base_url,
                   served_model_name=minilm_vllm.served_model_name, engine_block_json=block)
    stack.register("default", engine="vllm-server", base_url=smol_url, served_model_name="smol")
    wait_until(lambda: stack.cli("gateway", "chat", "default", "-m", "Hi", "--max-tokens", "2").returncode == 0,
               timeout_s=30, what="the default route answers")


def rag(stack: Stack, rag_dir: Path, *args: str, gateway: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"EXAMLOPS_RAG_DIR": str(rag_dir), **({"EXAMLOPS_GATEWAY_URL": gateway} if gateway else {})}
    return stack.cli("rag", *args, env=env, timeout=300)


def test_repo_docs_answered_by_smollm2_with_sources(stack: Stack, routes: None, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, source in DOCS.items():
        shutil.copy(REPO_ROOT / source, docs / name)
    store = tmp_path / "rag"

    t0 = time.monotonic()
    out = rag(stack, store, "index", str(docs), "--collection", "repo-docs")
    indexed_s = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    meta = json.loads((store / "repo-docs" / "meta.json").read_text())
    assert meta["embedding_model"] == "minilm" and meta["dimension"] == 384
    assert sorted(s["path"] for s in meta["sources"]) == sorted(DOCS)
    print(f"\nindexed {len(DOCS)} docs, {meta['chunks']} chunks through the real MiniLM: {indexed_s:.1f} s")

    questions = {"Which detectors can a guardrail policy use, and can it redact PII in prompts?": "GUARDRAILS.md",
                 "How does the gateway reserve budget before a call and settle the real cost after it?":
                     "GOVERNANCE.md"}
    for question, expected in questions.items():
        t0 = time.monotonic()
        out = rag(stack, store, "--json", "query", question, "--collection", "repo-docs", "--max-tokens", "64")
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        print(f"{question!r} in {time.monotonic() - t0:.1f} s -> {answer['answer']!r} "
              f"{[(s['source'], s['chunk'], s['score']) for s in answer['sources']]}")
        assert answer["answer"].strip() and answer["model"] == "default"
        assert answer["sources"][0]["source"] == expected
        assert answer["usage"]["completion_tokens"] > 0

    text = rag(stack, store, "query", next(iter(questions)), "--collection", "repo-docs", "--max-tokens", "32")
    assert text.returncode == 0 and "\nSources:\n  [1] GUARDRAILS.md (chunk " in text.stdout

    # A gateway of its own, answering, then stopped: the same query has no answer and exits 1.
    proc, own = stack.start_gateway_replica("gateway-rag")
    wait_until(lambda: rag(stack, store, "query", next(iter(questions)), "--collection", "repo-docs",
                           "--max-tokens", "8", gateway=own).returncode == 0,
               timeout_s=60, what="the new gateway answers once its routes are loaded")
    proc.stop()
    stopped = rag(stack, store, "query", next(iter(questions)), "--collection", "repo-docs", gateway=own)
    assert (stopped.returncode, stopped.stdout.strip()) == (1, "(no answer)")
    assert f"cannot reach the gateway at {own}" in stopped.stderr
