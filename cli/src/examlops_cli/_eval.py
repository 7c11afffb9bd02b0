"""The pinned evaluation of a model version and its gate (no CLI, no registry: plain functions).

    metrics = run_eval("http://127.0.0.1:8000", "smol")          # perplexity and task score
    decision = decide_gate(metrics, parent_eval, GateFloor())     # parent_eval: an EvalResult or None

The suite lives in evals/<suite>/ (texts.jsonl, tasks.jsonl); its id is `<suite>:<12 hex>`, the
first 12 hex digits of SHA-256 over texts.jsonl's bytes followed by tasks.jsonl's.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import orjson

SUITE_DIR_ENV = "EXAMLOPS_EVAL_SUITE_DIR"
SUITE_NAME = "examlops-eval-v1"
TASK_MAX_TOKENS = 16
#: (phase, done, total) after each item of a phase ("texts" or "tasks"), and once with done=0.
Progress = Callable[[str, int, int], None]
T = TypeVar("T")


class SuiteError(ValueError):
    """The suite's files are missing or malformed; the message names the file and line."""


class EngineError(RuntimeError):
    """The engine could not be reached or refused a request; the message names the URL."""


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    answer: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Suite:
    name: str
    digest: str                                  # full SHA-256 hex over texts.jsonl + tasks.jsonl
    texts: tuple[tuple[str, str], ...]           # (id, text)
    tasks: tuple[Task, ...]

    @property
    def id(self) -> str:
        return f"{self.name}:{self.digest[:12]}"


def suite_dir() -> Path:
    """$EXAMLOPS_EVAL_SUITE_DIR, else ./evals/examlops-eval-v1, else the checkout's copy."""
    if os.environ.get(SUITE_DIR_ENV):
        return Path(os.environ[SUITE_DIR_ENV])
    local = Path.cwd() / "evals" / SUITE_NAME
    if local.is_dir():
        return local
    return Path(__file__).resolve().parents[3] / "evals" / SUITE_NAME


def _jsonl(path: Path, keys: Mapping[str, bool]) -> list[dict[str, Any]]:
    """Objects of a JSONL file with only `keys` (True: required non-empty string), ids unique."""
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except OSError as exc:
        raise SuiteError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SuiteError(f"{path}: not UTF-8") from None
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise SuiteError(f"{path}:{n}: not JSON ({exc})") from None
        if not isinstance(row, dict) or set(row) - set(keys):
            raise SuiteError(f"{path}:{n}: each line is an object with keys {', '.join(keys)}")
        for key, required in keys.items():
            if required and not (isinstance(row.get(key), str) and row[key].strip()):
                raise SuiteError(f"{path}:{n}: {key!r} must be a non-empty string")
        if row["id"] in seen:
            raise SuiteError(f"{path}:{n}: id {row['id']!r} is given twice")
        seen.add(row["id"])
        rows.append(row)
    if not rows:
        raise SuiteError(f"{path}: no items")
    return rows


def load_suite(directory: Path | None = None) -> Suite:
    root = (directory or suite_dir()).resolve()
    texts_path, tasks_path = root / "texts.jsonl", root / "tasks.jsonl"
    texts = _jsonl(texts_path, {"id": True, "text": True})
    tasks: list[Task] = []
    for row in _jsonl(tasks_path, {"id": True, "prompt": True, "answer": True, "aliases": False}):
        aliases = row.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and normalise(a) for a in aliases):
            raise SuiteError(f"{tasks_path}: task {row['id']!r}: 'aliases' must be a list of non-empty strings")
        if not normalise(row["answer"]):
            raise SuiteError(f"{tasks_path}: task {row['id']!r}: the answer has no letters or digits")
        tasks.append(Task(row["id"], row["prompt"], row["answer"], tuple(aliases)))
    digest = hashlib.sha256(texts_path.read_bytes() + tasks_path.read_bytes()).hexdigest()
    return Suite(root.name, digest, tuple((t["id"], t["text"]) for t in texts), tuple(tasks))


def suite_id(directory: Path | None = None) -> str:
    return load_suite(directory).id


# --- scoring ---------------------------------------------------------------------------------

def normalise(text: str) -> str:
    """Lowercase; every character that is not a letter or digit becomes a space; spaces collapsed."""
    return " ".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def is_correct(reply: str, task: Task) -> bool:
    """The answer (or an alias) is the reply's first k words or its last k words (k: its length).

    "Paris", "Paris." and "Paris is the capital." match Paris, and so does "The capital of France
    is Paris." (small instruct models answer in a sentence that ends with the answer); "I think it
    is Paris or Lyon" does not.
    """
    words = normalise(reply).split()
    for accepted in (task.answer, *task.aliases):
        want = normalise(accepted).split()
        if words[:len(want)] == want or words[-len(want):] == want:
            return True
    return False


@dataclass(frozen=True)
class TaskAnswer:
    id: str
    expected: str
    reply: str
    correct: bool


@dataclass
class EvalMetrics:
    perplexity: float
    task_score: float                # share of tasks answered correctly, 0..1
    task_count: int
    suite: str
    scored_tokens: int               # tokens the perplexity averages over
    logprob_source: str              # echo (completions echo + logprobs) or prompt_logprobs (vLLM)
    duration_s: float
    answers: list[TaskAnswer] = field(default_factory=list)

    @property
    def correct(self) -> int:
        return sum(a.correct for a in self.answers)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "correct": self.correct}


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    url = f"{client.base_url}{path.lstrip('/')}"
    try:
        return client.post(path, json=body)
    except httpx.TimeoutException:
        raise EngineError(f"the engine at {url} did not answer within {client.timeout.read} s") from None
    except httpx.HTTPError as exc:
        raise EngineError(f"cannot reach the engine at {url}: {exc}") from None


def _ok(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code != 200:
        raise EngineError(f"the engine at {resp.request.url} answered {resp.status_code}: {resp.text[:300]}")
    try:
        data: dict[str, Any] = resp.json()
    except ValueError:
        raise EngineError(f"the engine at {resp.request.url} did not answer JSON: {resp.text[:200]}") from None
    return data


def _echo_logprobs(data: dict[str, Any], text: str) -> list[float] | None:
    """The prompt tokens' logprobs from an echo answer, the first (always null) and generated left out."""
    try:
        lp = data["choices"][0]["logprobs"]
        values: list[Any] = lp["token_logprobs"]
        count = (data.get("usage") or {}).get("prompt_tokens")
        if not isinstance(count, int):  # no usage: the prompt's tokens are those starting inside it
            count = sum(1 for off in lp["text_offset"] if off < len(text))
    except (KeyError, IndexError, TypeError):
        return None
    scored = values[1:count]
    if not scored or any(not isinstance(v, float | int) for v in scored):
        return None
    return [float(v) for v in scored]


def _prompt_logprobs(data: dict[str, Any]) -> list[float] | None:
    """vLLM's prompt_logprobs: per prompt token {token_id: {logprob, …}}; the first is null."""
    try:
        entries = data["choices"][0]["prompt_logprobs"][1:]
        values = [float(next(iter(e.values()))["logprob"]) for e in entries]
    except (KeyError, IndexError, TypeError, AttributeError, StopIteration, ValueError):
        return None
    return values or None


def text_logprobs(client: httpx.Client, model: str, text: str, source: str = "echo") -> tuple[list[float], str]:
    """The log-probabilities of a text's tokens (all but the first), and how they were obtained.

    `source` echo tries the OpenAI way (echo + logprobs) first and falls back to vLLM's
    prompt_logprobs; prompt_logprobs goes there directly.
    """
    base = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    if source == "echo":
        resp = _post(client, "/v1/completions", {**base, "echo": True, "logprobs": 0})
        if resp.status_code == 200:
            values = _echo_logprobs(_ok(resp), text)
            if values is not None:
                return values, "echo"
        elif resp.status_code != 400:
            _ok(resp)  # raises with the engine's answer
    values = _prompt_logprobs(_ok(_post(client, "/v1/completions", {**base, "prompt_logprobs": 0})))
    if values is None:
        raise EngineError(f"the engine at {client.base_url} returned no prompt log-probabilities "
                          "(neither echo + logprobs nor prompt_logprobs)")
    return values, "prompt_logprobs"


def ask(client: httpx.Client, model: str, prompt: str) -> str:
    data = _ok(_post(client, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": TASK_MAX_TOKENS}))
    try:
        return str(data["choices"][0]["message"]["content"] or "")
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"the engine at {client.base_url} answered a chat without a message") from None


def run_eval(base_url: str, served_model_name: str, progress: Progress | None = None, *,
             suite: Suite | None = None, timeout: float = 120.0) -> EvalMetrics:
    """Perplexity over the suite's texts and exact-match score over its tasks, from one engine."""
    suite = suite or load_suite()
    note = progress or (lambda phase, done, total: None)
    started = time.monotonic()
    total, count, source = 0.0, 0, "echo"
    with httpx.Client(base_url=base_url.rstrip("/") + "/", timeout=timeout) as client:
        note("texts", 0, len(suite.texts))
        for i, (_, text) in enumerate(suite.texts, 1):
            values, source = text_logprobs(client, served_model_name, text, source)
            total, count = total + sum(values), count + len(values)
            note("texts", i, len(suite.texts))
        answers: list[TaskAnswer] = []
        note("tasks", 0, len(suite.tasks))
        for i, task in enumerate(suite.tasks, 1):
            reply = ask(client, served_model_name, task.prompt)
            answers.append(TaskAnswer(task.id, task.answer, reply, is_correct(reply, task)))
            note("tasks", i, len(suite.tasks))
    perplexity = math.exp(-total / count) if count else math.inf
    return EvalMetrics(perplexity=perplexity, task_score=sum(a.correct for a in answers) / len(answers),
                       task_count=len(answers), suite=suite.id, scored_tokens=count, logprob_source=source,
                       duration_s=round(time.monotonic() - started, 2), answers=answers)


# --- the gate --------------------------------------------------------------------------------

class Scores(Protocol):
    """What the gate compares: an EvalMetrics, or an EvalResult the registry recorded."""

    @property
    def perplexity(self) -> float: ...
    @property
    def task_score(self) -> float: ...


@dataclass(frozen=True)
class GateFloor:
    max_perplexity_ratio: float = 1.10       # perplexity <= ratio x the parent's
    min_task_score_ratio: float = 0.95       # task score >= ratio x the parent's
    max_perplexity: float | None = None      # absolute, for every version
    min_task_score: float | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> GateFloor:
        """From a pack model's `eval_gate:` (already validated); unset keys keep their default."""
        return cls(**{k: v for k, v in (data or {}).items() if v is not None})


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    gate: str        # the floors applied, in words
    reason: str      # why it refused; empty when it passed


BASELINE = "no parent: recorded as the baseline"


def latest_on_suite(evals: Sequence[T], suite: str) -> T | None:
    """The newest eval (evals are oldest first) on this suite; another suite's numbers do not compare."""
    return next((e for e in reversed(evals) if getattr(e, "suite", None) == suite), None)


def decide_gate(metrics: Scores, parent: Scores | None, floor: GateFloor | None = None) -> GateDecision:
    """Pass or refuse `metrics` against the parent's latest eval (None for a base version) and floors."""
    f = floor or GateFloor()
    ppl, score = metrics.perplexity, metrics.task_score
    checks: list[tuple[str, bool, str]] = []  # (rule, holds, refusal)
    if parent is not None:
        pp, ps = parent.perplexity, parent.task_score
        most, least = f.max_perplexity_ratio * pp, f.min_task_score_ratio * ps
        checks += [
            (f"perplexity <= {f.max_perplexity_ratio:.2f} x parent's {pp:.2f} = {most:.2f}", ppl <= most,
             f"perplexity {ppl:.2f} > {most:.2f} ({f.max_perplexity_ratio:.2f} x parent's {pp:.2f})"),
            (f"task score >= {f.min_task_score_ratio:.2f} x parent's {ps:.3f} = {least:.3f}", score >= least,
             f"task score {score:.3f} < {least:.3f} ({f.min_task_score_ratio:.2f} x parent's {ps:.3f})")]
    if f.max_perplexity is not None:
        checks.append((f"perplexity <= {f.max_perplexity:g}", ppl <= f.max_perplexity,
                       f"perplexity {ppl:.2f} > the floor {f.max_perplexity:g}"))
    if f.min_task_score is not None:
        checks.append((f"task score >= {f.min_task_score:g}", score >= f.min_task_score,
                       f"task score {score:.3f} < the floor {f.min_task_score:g}"))
    refusals = [] if math.isfinite(ppl) else [f"perplexity is {ppl} (not a finite number)"]
    refusals += [refusal for _, holds, refusal in checks if not holds]
    rules = "; ".join(rule for rule, _, _ in checks)
    gate = (rules if parent is not None else f"no parent; {rules}") if checks else BASELINE
    return GateDecision(passed=not refusals, gate=gate, reason="; ".join(refusals))
