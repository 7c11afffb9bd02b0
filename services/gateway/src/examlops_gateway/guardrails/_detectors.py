"""The guardrail detectors' contract: what a finding is, how a detector is built and how a text is redacted.

A detector scans one text synchronously on the CPU (no network, thread-safe) and returns findings:
character spans naming an entity type, never the matched text itself. Three kinds are built here
from a policy's fields (`build_detector`): `pii` (Presidio's pattern recognizers, _pii.py),
`secrets` (well-known credential formats and high-entropy tokens, _secrets.py) and `regex` (an
operator's deny-list pattern, _regex.py). The fourth kind, `model`, is asynchronous and lives in
_judge.py. `max_match_chars` is the longest span one finding can cover, so that a streamed answer's
output stage holds back that many characters and never releases part of a match (see GUARDRAILS.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Finding:
    detector: str   # "pii" | "secrets" | "regex" | "model"
    entity: str     # "EMAIL_ADDRESS", "AWS_ACCESS_KEY", "DENY_PATTERN", "UNSAFE", ...
    start: int      # character offsets in the scanned text (0, 0 for a whole-text verdict such as model)
    end: int
    score: float = 1.0


class Detector(Protocol):
    kind: str
    max_match_chars: int

    def scan(self, text: str) -> list[Finding]: ...


class DetectorConfigError(ValueError):
    """A detector's fields are wrong; the message starts with the field's name."""


KINDS = ("pii", "secrets", "regex")


def known_entities(kind: str) -> list[str]:
    """The entity types a detector kind can report (those `entities` may name)."""
    if kind == "pii":
        from ._pii import PII_ENTITIES
        return list(PII_ENTITIES)
    if kind == "secrets":
        from ._secrets import SECRET_ENTITIES
        return list(SECRET_ENTITIES)
    if kind == "regex":
        return ["DENY_PATTERN"]
    raise DetectorConfigError(f"detector: unknown detector {kind!r} (known: {', '.join(KINDS)}, model)")


def check_entities(kind: str, entities: list[str] | None) -> tuple[str, ...]:
    """The entities asked for, all of them when none are named; an unknown one is refused by name."""
    known = known_entities(kind)
    if not entities:
        return tuple(known)
    for entity in entities:
        if entity not in known:
            raise DetectorConfigError(f"entities: unknown entity {entity!r} for {kind} (known: {', '.join(known)})")
    return tuple(dict.fromkeys(entities))


def build_detector(kind: str, entities: list[str] | None = None, pattern: str | None = None) -> Detector:
    """One detector from a policy's fields; DetectorConfigError names the field that is wrong."""
    chosen = check_entities(kind, entities)
    if kind != "regex" and pattern is not None:
        raise DetectorConfigError(f"pattern: only the regex detector takes a pattern, not {kind}")
    if kind == "regex" and pattern is None:
        raise DetectorConfigError("pattern: the regex detector needs a pattern")
    return _built(kind, chosen, pattern)


@functools.lru_cache(maxsize=64)
def _built(kind: str, chosen: tuple[str, ...], pattern: str | None) -> Detector:
    """One detector per configuration, shared by every rule that names it (detectors keep no state
    between scans). Every policy change rebuilds each replica's rules and every policy PUT is checked
    by building its detectors: without this, each rebuild made new Presidio detectors, which
    PiiDetector's gc.freeze() keeps forever (measured: a gateway grew past 3.5 GB over the guardrail
    tests' few hundred policy changes)."""
    if kind == "regex":
        from ._regex import RegexDetector
        return RegexDetector(pattern or "")
    if kind == "pii":
        from ._pii import PiiDetector
        return PiiDetector(chosen)
    from ._secrets import SecretsDetector
    return SecretsDetector(chosen)


def redact(text: str, findings: list[Finding]) -> str:
    """`text` with each finding's span replaced by Presidio's placeholder `<ENTITY>`.

    Overlapping spans are merged into one placeholder, named after the highest-scoring finding
    among them (the longest on a tie), so no character of any match survives. Whole-text verdicts
    (start == end) replace nothing. Without overlaps the output is presidio-anonymizer's `replace`.
    """
    spans = sorted((f for f in findings if f.end > f.start), key=lambda f: (f.start, -f.end))
    merged: list[tuple[int, int, Finding]] = []
    for f in spans:
        if merged and f.start < merged[-1][1]:
            start, end, best = merged[-1]
            if (f.score, f.end - f.start) > (best.score, best.end - best.start):
                best = f
            merged[-1] = (start, max(end, f.end), best)
        else:
            merged.append((f.start, f.end, f))
    parts: list[str] = []
    cursor = 0
    for start, end, best in merged:
        parts += [text[cursor:start], f"<{best.entity}>"]
        cursor = end
    parts.append(text[cursor:])
    return "".join(parts)
