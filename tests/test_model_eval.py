"""The pinned evaluation without a model: the suite, exact match, the gate, the pack's eval_gate, and the
HTTP side against a small stand-in server (echo logprobs, the prompt_logprobs fallback, errors)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from examlops.engine import EngineBlockError, load_model_file
from examlops.registry.v1 import registry_pb2 as reg
from examlops_cli._eval import (
    BASELINE,
    EngineError,
    EvalMetrics,
    GateFloor,
    SuiteError,
    Task,
    decide_gate,
    is_correct,
    latest_on_suite,
    load_suite,
    normalise,
    run_eval,
    suite_id,
)
from examlops_testsupport import REPO_ROOT

SUITE = REPO_ROOT / "evals" / "examlops-eval-v1"


def metrics(perplexity: float, task_score: float) -> EvalMetrics:
    return EvalMetrics(perplexity=perplexity, task_score=task_score, task_count=30, suite="s:1",
                       scored_tokens=100, logprob_source="echo", duration_s=1.0)


# --- the suite -------------------------------------------------------------------------------

def test_the_pinned_suite_is_what_its_readme_says() -> None:
    suite = load_suite(SUITE)
    assert 20 <= len(suite.texts) <= 30 and 25 <= len(suite.tasks) <= 35
    assert all(60 <= len(text.split()) <= 120 for _, text in suite.texts)
    digest = hashlib.sha256((SUITE / "texts.jsonl").read_bytes() + (SUITE / "tasks.jsonl").read_bytes()).hexdigest()
    assert suite.id == suite_id(SUITE) == f"examlops-eval-v1:{digest[:12]}"
    readme = (SUITE / "README.md").read_text()
    assert "examlops-eval-v1:<h>" in readme and "first 12 hex digits" in readme
    assert f"{len(suite.texts)} held-out" in readme and f"{len(suite.tasks)} short questions" in readme


def test_the_suite_is_found_from_the_environment_or_the_checkout(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_suite().id == load_suite(SUITE).id
    copy = tmp_path / "mine"
    shutil.copytree(SUITE, copy)
    with (copy / "tasks.jsonl").open("a") as f:
        f.write(json.dumps({"id": "extra", "prompt": "1+1=", "answer": "2"}) + "\n")
    monkeypatch.setenv("EXAMLOPS_EVAL_SUITE_DIR", str(copy))
    changed = load_suite()
    assert changed.name == "mine" and len(changed.tasks) == len(load_suite(SUITE).tasks) + 1
    assert changed.digest != load_suite(SUITE).digest  # any change to a file changes the id


@pytest.mark.parametrize(("file", "line", "message"), [
    ("texts.jsonl", "not json", "texts.jsonl:2: not JSON"),
    ("texts.jsonl", '{"id": "b"}', "texts.jsonl:2: 'text' must be a non-empty string"),
    ("texts.jsonl", '{"id": "a", "text": "again"}', "texts.jsonl:2: id 'a' is given twice"),
    ("texts.jsonl", '{"id": "b", "text": "x", "lang": "en"}', "texts.jsonl:2: each line is an object with keys"),
    ("tasks.jsonl", '{"id": "b", "prompt": "p", "answer": " "}', "tasks.jsonl:2: 'answer' must be"),
    ("tasks.jsonl", '{"id": "b", "prompt": "p", "answer": "?!"}', "task 'b': the answer has no letters or digits"),
    ("tasks.jsonl", '{"id": "b", "prompt": "p", "answer": "x", "aliases": "y"}', "'aliases' must be a list"),
])
def test_a_malformed_suite_names_file_and_line(tmp_path: Path, file: str, line: str, message: str) -> None:
    (tmp_path / "texts.jsonl").write_text('{"id": "a", "text": "Some text."}\n')
    (tmp_path / "tasks.jsonl").write_text('{"id": "a", "prompt": "1+1=", "answer": "2"}\n')
    with (tmp_path / file).open("a") as f:
        f.write(line + "\n")
    with pytest.raises(SuiteError, match=re.escape(message)):
        load_suite(tmp_path)


def test_a_missing_suite_is_a_suite_error(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match=r"texts\.jsonl"):
        load_suite(tmp_path)


# --- exact match -----------------------------------------------------------------------------

def test_normalise() -> None:
    assert normalise('  The answer is "Paris".\n') == "the answer is paris"
    assert normalise("CO₂, H2O!") == "co₂ h2o"


@pytest.mark.parametrize(("reply", "correct"), [
    ("Paris", True), ("paris.", True), ("PARIS!", True), ("Paris is the capital of France.", True),
    ("The capital of France is Paris.", True), ('The answer is "Paris"', True),
    ("Parisian food is good", False), ("I think it is Paris or Lyon", False), ("", False), ("Lyon", False),
])
def test_the_answer_is_the_first_or_last_words(reply: str, correct: bool) -> None:
    assert is_correct(reply, Task("q", "capital of France?", "Paris")) is correct


def test_aliases_and_answers_of_several_words() -> None:
    task = Task("q", "largest ocean?", "Pacific", ("Pacific Ocean",))
    assert is_correct("The largest ocean on Earth is the Pacific Ocean.", task)
    assert is_correct("Pacific Ocean, by far", task)
    assert not is_correct("The Atlantic Ocean", task)
    seven = Task("q", "days in a week?", "7", ("seven",))
    assert is_correct("Seven.", seven) and is_correct("7", seven)
    assert not is_correct("A week is 7 days.", seven) and not is_correct("17", seven)


# --- the gate --------------------------------------------------------------------------------

def test_a_base_version_without_floors_is_the_baseline() -> None:
    decision = decide_gate(metrics(500.0, 0.0), None, GateFloor())
    assert decision.passed and decision.gate == BASELINE == "no parent: recorded as the baseline"
    assert decision.reason == ""


def test_the_default_floor_is_relative_to_the_parent() -> None:
    parent = metrics(20.0, 0.8)
    ok = decide_gate(metrics(22.0, 0.76), parent)  # exactly 1.10 x and 0.95 x: still passes
    assert ok.passed and ok.reason == ""
    assert ok.gate == "perplexity <= 1.10 x parent's 20.00 = 22.00; task score >= 0.95 x parent's 0.800 = 0.760"
    worse = decide_gate(metrics(22.5, 0.8), parent)
    assert not worse.passed and worse.reason == "perplexity 22.50 > 22.00 (1.10 x parent's 20.00)"
    dumber = decide_gate(metrics(20.0, 0.7), parent)
    assert not dumber.passed and dumber.reason == "task score 0.700 < 0.760 (0.95 x parent's 0.800)"
    both = decide_gate(metrics(30.0, 0.1), parent)
    assert not both.passed and both.reason.count(";") == 1
    assert decide_gate(metrics(15.0, 1.0), parent).passed  # better is fine


def test_floors_of_the_pack_are_applied() -> None:
    floor = GateFloor(max_perplexity_ratio=1.02, min_task_score_ratio=1.0, max_perplexity=25, min_task_score=0.5)
    parent = metrics(20.0, 0.6)
    assert decide_gate(metrics(20.4, 0.6), parent, floor).passed
    refused = decide_gate(metrics(20.5, 0.45), parent, floor)
    assert refused.reason == ("perplexity 20.50 > 20.40 (1.02 x parent's 20.00); "
                              "task score 0.450 < 0.600 (1.00 x parent's 0.600); task score 0.450 < the floor 0.5")
    assert refused.gate.endswith("; perplexity <= 25; task score >= 0.5")
    base = decide_gate(metrics(30.0, 0.6), None, floor)  # absolute floors hold for a base version too
    assert not base.passed and base.gate == "no parent; perplexity <= 25; task score >= 0.5"
    assert base.reason == "perplexity 30.00 > the floor 25"


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_perplexity_that_is_not_a_number_never_passes(bad: float) -> None:
    assert not decide_gate(metrics(bad, 1.0), None).passed
    assert not decide_gate(metrics(bad, 1.0), metrics(20.0, 0.5)).passed


def test_the_parent_is_its_latest_eval_on_the_same_suite() -> None:
    evals = [reg.EvalResult(suite="s:1", perplexity=30.0, task_score=0.5),
             reg.EvalResult(suite="s:1", perplexity=25.0, task_score=0.6),
             reg.EvalResult(suite="s:0", perplexity=99.0, task_score=0.1)]
    parent = latest_on_suite(evals, "s:1")
    assert parent is not None and parent.perplexity == 25.0
    assert latest_on_suite(evals, "s:2") is None
    assert decide_gate(metrics(27.0, 0.6), parent).passed  # an EvalResult compares like EvalMetrics


# --- eval_gate in a pack's model file ----------------------------------------------------------

GOOD = "engine:\n  engine: vllm\n  hf_model_id: org/model\n"


def test_a_model_file_may_set_its_eval_gate(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(GOOD + "eval_gate:\n  max_perplexity_ratio: 1.05\n  min_task_score: 0.5\n")
    spec = load_model_file(path)
    assert spec.eval_gate is not None
    floor = GateFloor.from_mapping(spec.eval_gate.model_dump())
    assert floor == GateFloor(max_perplexity_ratio=1.05, min_task_score_ratio=0.95, min_task_score=0.5)
    path.write_text(GOOD)
    assert load_model_file(path).eval_gate is None and GateFloor.from_mapping(None) == GateFloor()


@pytest.mark.parametrize(("gate", "message"), [
    ("  max_perplexity_ratio: 0", "eval_gate.max_perplexity_ratio: Input should be greater than 0"),
    ("  min_task_score: 1.5", "eval_gate.min_task_score: Input should be less than or equal to 1"),
    ("  max_perplexity: lots", "eval_gate.max_perplexity: Input should be a valid number"),
    ("  min_task_score_ratio: -1", "eval_gate.min_task_score_ratio: Input should be greater than or equal to 0"),
    ("  max_ppl: 3", "eval_gate.max_ppl: unknown key 'max_ppl'"),
])
def test_a_bad_eval_gate_is_refused_clearly(tmp_path: Path, gate: str, message: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(GOOD + "eval_gate:\n" + gate + "\n")
    with pytest.raises(EngineBlockError) as caught:
        load_model_file(path)
    (line,) = caught.value.lines()
    assert line.startswith(f"{path}: {message}")


# --- the HTTP side, against a stand-in server --------------------------------------------------

class Engine(BaseHTTPRequestHandler):
    """An OpenAI-compatible stand-in: every prompt token has logprob -2; answers are scripted."""

    echo = True
    replies: dict[str, str] = {}  # noqa: RUF012

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/chat/completions":
            prompt = body["messages"][0]["content"]
            self.answer(200, {"choices": [{"message": {"content": self.replies.get(prompt, "no idea")}}]})
            return
        words = body["prompt"].split()
        if body.get("echo"):
            if not self.echo:
                self.answer(400, {"error": "echo is not supported"})
                return
            logprobs = {"token_logprobs": [None] + [-2.0] * (len(words) - 1) + [-0.5],
                        "text_offset": list(range(len(words) + 1))}
            self.answer(200, {"choices": [{"logprobs": logprobs}], "usage": {"prompt_tokens": len(words)}})
            return
        entries = [None] + [{"7": {"logprob": -2.0, "rank": 1}} for _ in words[1:]]
        self.answer(200, {"choices": [{"prompt_logprobs": entries}]})

    def answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    Engine.echo = True


def test_run_eval_scores_texts_and_tasks(engine: str) -> None:
    suite = load_suite(SUITE)
    Engine.replies = {t.prompt: f"The answer is {t.answer}." for t in suite.tasks[:10]}
    seen: list[tuple[str, int, int]] = []
    result = run_eval(engine, "smol", lambda *a: seen.append(a), suite=suite)
    assert result.perplexity == pytest.approx(math.exp(2.0))  # the generated token is not scored
    assert result.scored_tokens == sum(len(text.split()) - 1 for _, text in suite.texts)
    assert result.logprob_source == "echo" and result.suite == suite.id
    assert result.correct == 10 and result.task_score == pytest.approx(10 / len(suite.tasks))
    assert seen[0] == ("texts", 0, len(suite.texts)) and seen[-1] == ("tasks", len(suite.tasks), len(suite.tasks))
    assert result.as_dict()["answers"][0] == {"id": suite.tasks[0].id, "expected": suite.tasks[0].answer,
                                              "reply": f"The answer is {suite.tasks[0].answer}.", "correct": True}


def test_without_echo_the_prompt_logprobs_are_used(engine: str) -> None:
    Engine.echo = False
    result = run_eval(engine, "smol", suite=load_suite(SUITE))
    assert result.logprob_source == "prompt_logprobs" and result.perplexity == pytest.approx(math.exp(2.0))


def test_an_unreachable_engine_is_named() -> None:
    with pytest.raises(EngineError, match=r"cannot reach the engine at http://127\.0\.0\.1:9/v1/completions"):
        run_eval("http://127.0.0.1:9", "smol", suite=load_suite(SUITE), timeout=5)
