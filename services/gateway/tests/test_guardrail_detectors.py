"""The guardrail detectors against a labelled corpus (precision and recall printed, floors asserted),
plus redaction, the deny-list pattern checks and the model judge's answer contract.

data/guardrail_corpus.jsonl: one text a line with the (detector/entity) pairs it must yield. Values
are public test data (card networks' test numbers, registries' example IBANs, AWS's documented
example keys), fictional numbers, or random strings; none is a live credential. Look-alikes
(expect: []) are what chat is full of: order and tracking numbers, dates, prices, versions, ISBNs,
UUIDs, git SHAs, digests, identifiers, paths, placeholders, cards and IBANs failing their checksum.
Run with `-s` (or `-rA`) to see the table; GUARDRAILS.md quotes it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
from presidio_anonymizer import AnonymizerEngine
from presidio_anonymizer.entities import RecognizerResult

from examlops_gateway.guardrails import (
    DetectorConfigError,
    Finding,
    JudgeError,
    ModelJudge,
    build_detector,
    known_entities,
    redact,
)

CORPUS = [(row["text"], {tuple(label.split("/")) for label in row["expect"]}) for row in
          map(json.loads, (Path(__file__).parent / "data" / "guardrail_corpus.jsonl").read_text().splitlines())]
DENY_PATTERN = r"(?i)\bproject\s{1,3}(?:falcon|osprey)\b"   # the corpus' operator deny-list
FLOORS = {"pii": (0.95, 0.90), "secrets": (0.95, 0.90), "regex": (1.0, 1.0)}   # (precision, recall)


def _measure() -> tuple[Counter[tuple[str, str, str]], list[str]]:
    """Counts of tp/fp/fn by (detector, entity), and one line per miss or false alarm."""
    detectors = [build_detector("pii"), build_detector("secrets"), build_detector("regex", pattern=DENY_PATTERN)]
    counts: Counter[tuple[str, str, str]] = Counter()
    errors: list[str] = []
    for text, expected in CORPUS:
        found = {(f.detector, f.entity) for d in detectors for f in d.scan(text)}
        for label in found | expected:
            outcome = "tp" if label in found and label in expected else "fp" if label in found else "fn"
            counts[(label[0], label[1], outcome)] += 1
            if outcome != "tp":
                errors.append(f"{outcome} {label[0]}/{label[1]}: {text[:70]!r}")
    return counts, errors


def _ratio(hit: int, other: int) -> float:
    return hit / (hit + other) if hit + other else 1.0


def _table(counts: Counter[tuple[str, str, str]]) -> tuple[str, dict[str, tuple[float, float]]]:
    rows = sorted({(d, e) for d, e, _ in counts})
    lines = [f"{'detector':<9} {'entity':<18} {'tp':>4} {'fp':>4} {'fn':>4} {'precision':>9} {'recall':>7}"]
    totals: dict[str, tuple[float, float]] = {}
    for detector in sorted({d for d, _ in rows}):
        for d, e in [r for r in rows if r[0] == detector] + [(detector, "(all)")]:
            tp, fp, fn = (sum(n for (cd, ce, o), n in counts.items() if cd == d and e in ("(all)", ce) and o == k)
                          for k in ("tp", "fp", "fn"))
            p, r = _ratio(tp, fp), _ratio(tp, fn)
            lines.append(f"{d:<9} {e:<18} {tp:>4} {fp:>4} {fn:>4} {p:>9.3f} {r:>7.3f}")
            if e == "(all)":
                totals[d] = (p, r)
    return "\n".join(lines), totals


def test_precision_and_recall_per_detector_meet_their_floors() -> None:
    assert len(CORPUS) >= 200
    counts, errors = _measure()
    table, totals = _table(counts)
    print(f"\nguardrail corpus: {len(CORPUS)} texts\n{table}\n" + "\n".join(errors))
    for detector, (p_floor, r_floor) in FLOORS.items():
        p, r = totals[detector]
        assert p >= p_floor and r >= r_floor, f"{detector}: precision {p:.3f} recall {r:.3f}\n{table}"


def test_redact_uses_presidio_placeholders_and_matches_presidio_anonymizer() -> None:
    text = "Mail alice@example.com or call +44 20 7946 0958; card 4111 1111 1111 1111."
    findings = build_detector("pii").scan(text)
    assert redact(text, findings) == "Mail <EMAIL_ADDRESS> or call <PHONE_NUMBER>; card <CREDIT_CARD>."
    reference = AnonymizerEngine().anonymize(
        text, [RecognizerResult(f.entity, f.start, f.end, f.score) for f in findings]).text
    assert redact(text, findings) == reference


def test_redact_merges_overlapping_spans_under_the_strongest_finding() -> None:
    text = "0123456789abcdefghij"
    overlapping = [Finding("pii", "PHONE_NUMBER", 2, 8, 0.4), Finding("secrets", "HIGH_ENTROPY", 5, 12, 0.6),
                   Finding("regex", "DENY_PATTERN", 15, 18), Finding("model", "UNSAFE", 0, 0)]
    assert redact(text, overlapping) == "01<HIGH_ENTROPY>cde<DENY_PATTERN>ij"
    contained = [Finding("pii", "US_SSN", 0, 5), Finding("pii", "PHONE_NUMBER", 1, 3)]
    assert redact(text, contained) == "<US_SSN>56789abcdefghij"
    assert redact(text, []) == text


@pytest.mark.parametrize(("pattern", "message"), [
    (r"(a+)+b", "pattern: a quantifier inside a repeated group"),
    (r"(\w{1,9}){1,9}", "pattern: a quantifier inside a repeated group"),
    (r"secret\s+word", "pattern: has unbounded repetition"),
    (r"x{2000}", "pattern: can match 2000 characters"),
    ("[unclosed", "pattern: invalid regex"),
    ("a?", "pattern: matches the empty string"),
    ("a" * 600, "pattern: 600 characters"),
])
def test_regex_detector_refuses_unsafe_or_invalid_patterns_naming_the_field(pattern: str, message: str) -> None:
    with pytest.raises(DetectorConfigError, match=re.escape(message)):
        build_detector("regex", pattern=pattern)


def test_regex_detector_reports_its_longest_match_and_fails_closed_on_a_runaway_scan() -> None:
    deny = build_detector("regex", pattern=DENY_PATTERN)
    assert deny.max_match_chars == len("project   osprey")
    assert [(f.start, f.end) for f in deny.scan("ask about Project Falcon")] == [(10, 24)]
    slow = build_detector("regex", pattern=r"(?:a|aa){1,60}b")   # exponential, bounded: the timeout cuts it
    assert slow.scan("a" * 80) == [Finding("regex", "DENY_PATTERN", 0, 80)]


def test_unknown_detector_or_entity_is_refused_by_field() -> None:
    with pytest.raises(DetectorConfigError, match="detector: unknown detector 'foo'"):
        build_detector("foo")
    with pytest.raises(DetectorConfigError, match=r"entities: unknown entity 'FOO'.*EMAIL_ADDRESS"):
        build_detector("pii", entities=["FOO"])
    assert build_detector("pii", entities=["EMAIL_ADDRESS"]).scan("call +1 415 555 0132, a@example.com") == [
        Finding("pii", "EMAIL_ADDRESS", 22, 35, 1.0)]
    assert "PERSON" not in known_entities("pii")   # no spaCy model is installed here, and none is downloaded


class Judge:
    """A real asyncio callable standing in for a route: answers `content` after `delay_s`, records requests."""

    def __init__(self, content: str | None, delay_s: float = 0.0, body: bytes | None = None) -> None:
        self.content, self.delay_s, self.body, self.requests = content, delay_s, body, []

    async def __call__(self, route: str, request: bytes, timeout_s: float) -> bytes:
        self.requests.append((route, orjson.loads(request), timeout_s))
        await asyncio.sleep(self.delay_s)
        if self.body is not None:
            return self.body
        return orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": self.content}}]})


@pytest.mark.parametrize(("answer", "unsafe"), [
    ("safe", False), ("Safe.", False), (" safe\n", False), ("unsafe", True), ("UNSAFE", True),
    ("unsafe\nS1", True), ("unsafe\nS10,S11", True), ("**unsafe**", True),
])
def test_judge_reads_plain_and_llama_guard_answers(answer: str, unsafe: bool) -> None:
    judge = Judge(answer)
    found = asyncio.run(ModelJudge("guard", judge, timeout_s=1.0).scan("how do I bake bread?"))
    assert found == ([Finding("model", "UNSAFE", 0, 0)] if unsafe else [])
    route, request, _ = judge.requests[0]
    assert route == "guard" and request["temperature"] == 0 and request["model"] == "guard"
    assert request["messages"][0]["role"] == "system" and "safe or unsafe" in request["messages"][0]["content"]
    assert request["messages"][1] == {"role": "user", "content": "how do I bake bread?"}


@pytest.mark.parametrize("judge", [
    Judge("I cannot help with that"), Judge(""), Judge(None), Judge("sa fe"), Judge(None, body=b"not json"),
    Judge(None, body=b'{"error": {"message": "model not found"}}'),
])
def test_judge_raises_on_an_answer_it_cannot_read(judge: Judge) -> None:
    with pytest.raises(JudgeError):
        asyncio.run(ModelJudge("guard", judge).scan("text"))


def test_judge_times_out_and_raises_instead_of_waiting() -> None:
    started = time.monotonic()
    with pytest.raises(JudgeError, match=r"did not answer within 0\.05 s"):
        asyncio.run(ModelJudge("guard", Judge("safe", delay_s=5.0), timeout_s=0.05).scan("text"))
    assert time.monotonic() - started < 1.0


def test_judge_turns_a_failing_route_into_judge_error() -> None:
    async def refused(route: str, request: bytes, timeout_s: float) -> bytes:
        raise ConnectionRefusedError("route down")

    with pytest.raises(JudgeError, match="failed: ConnectionRefusedError"):
        asyncio.run(ModelJudge("guard", refused).scan("text"))


def test_a_detector_is_built_once_per_configuration() -> None:
    """Rules rebuilt on every policy change share their detectors: a rebuilt Presidio detector was
    never freed (gc.freeze), and a gateway grew by gigabytes over a few hundred policy changes."""
    assert build_detector("pii") is build_detector("pii", entities=None)
    assert build_detector("pii", entities=["EMAIL_ADDRESS"]) is build_detector("pii", entities=["EMAIL_ADDRESS"])
    assert build_detector("pii", entities=["EMAIL_ADDRESS"]) is not build_detector("pii")
    assert build_detector("regex", pattern="a{1,5}b") is build_detector("regex", pattern="a{1,5}b")
    assert build_detector("regex", pattern="a{1,5}b") is not build_detector("regex", pattern="a{1,5}c")
