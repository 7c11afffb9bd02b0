"""The pinned evaluation on real SmolLM2 behind a CPU `vllm serve` (no registry): perplexity through
echo logprobs, the same number through vLLM's prompt_logprobs, a task score above zero, and the gate
between two runs of the same model."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import httpx
import pytest

from examlops_cli._eval import EvalMetrics, decide_gate, load_suite, run_eval, text_logprobs
from examlops_testsupport.vllm import smol_server

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with smol_server(tmp_path_factory.mktemp("vllm-eval")) as url:
        yield url


@pytest.fixture(scope="module")
def smol(server: str) -> EvalMetrics:
    t0 = time.monotonic()
    result = run_eval(server, "smol")
    print(f"\nSmolLM2 on {result.suite}: perplexity {result.perplexity:.2f} over {result.scored_tokens} tokens "
          f"({result.logprob_source}), task score {result.task_score:.3f} ({result.correct}/{result.task_count}), "
          f"{time.monotonic() - t0:.1f} s")
    return result


def test_smollm2_perplexity_and_task_score(smol: EvalMetrics) -> None:
    assert smol.logprob_source == "echo"
    assert math.isfinite(smol.perplexity) and 5 < smol.perplexity < 200
    assert smol.task_score > 0 and smol.task_count == len(load_suite().tasks)
    assert smol.duration_s < 120
    paris = next(a for a in smol.answers if a.expected == "Paris")
    assert paris.correct, paris.reply


def test_prompt_logprobs_give_the_same_numbers_as_echo(server: str) -> None:
    _, text = load_suite().texts[0]
    with httpx.Client(base_url=server + "/", timeout=120) as client:
        echoed, how = text_logprobs(client, "smol", text, "echo")
        assert how == "echo"
        direct, how = text_logprobs(client, "smol", text, "prompt_logprobs")
        assert how == "prompt_logprobs"
    assert len(direct) == len(echoed) > 50
    assert direct == pytest.approx(echoed, abs=0.05)


def test_the_same_model_passes_its_own_gate_and_greedy_answers_repeat(server: str, smol: EvalMetrics) -> None:
    again = run_eval(server, "smol")
    assert decide_gate(again, smol).passed
    assert [a.reply for a in again.answers] == [a.reply for a in smol.answers]
    assert again.perplexity == pytest.approx(smol.perplexity, rel=0.01)
