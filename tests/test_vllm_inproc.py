"""vllm-inproc for real: `exa serve llm batch` scores a corpus with the CPU vLLM in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examlops_testsupport.fixtures import Stack
from examlops_testsupport.vllm import smol_model_dir

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent


def test_batch_scores_a_corpus_in_process(stack: Stack, tmp_path: Path) -> None:
    corpus = tmp_path / "prompts.jsonl"
    lines = [{"id": "q1", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 8},
             {"id": "q2", "messages": [{"role": "user", "content": "Name a colour."}]},
             {"prompt": "The capital of France is", "max_tokens": 6},
             {"id": "q4", "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 4}]
    corpus.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "results.jsonl"
    run = stack.cli("--json", "serve", "llm", "batch", "smol", "--input", str(corpus), "--output", str(out),
                    "--weights", str(smol_model_dir()), "--max-tokens", "12", "--batch-size", "3", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["scored"] == 4 and summary["errors"] == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["q1", "q2", "3", "q4"]
    for r in results:
        assert r["text"].strip() and r["prompt_tokens"] > 0 and r["completion_tokens"] > 0
    assert results[0]["completion_tokens"] <= 8 and results[1]["completion_tokens"] <= 12
    print(f"\nin-process vLLM load: {summary['load_s']} s")


def test_batch_refuses_a_bad_corpus_before_loading_anything(stack: Stack, tmp_path: Path) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    out = tmp_path / "never.jsonl"
    run = stack.cli("serve", "llm", "batch", "smol", "--input", str(corpus), "--output", str(out))
    assert run.returncode == 1 and f"{corpus}:2" in run.stderr
    assert not out.exists()


def test_pack_check_with_vllms_own_parser(stack: Stack) -> None:
    run = stack.cli("models", "engine", "check", str(ROOT / "usecases"), "--vllm-parser", timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
