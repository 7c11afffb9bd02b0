"""The `regex` detector: one operator deny-list pattern, refused at configuration when it could run away.

Engine choice: patterns are compiled once with the `regex` package (already a dependency of
Presidio) because it takes a per-call `timeout`, which the standard `re` lacks and re2 would give
only through a native wheel. Three checks refuse a pattern before it is stored, each naming the
`pattern` field: its length (≤ 512 characters), its syntax (Python `re` syntax, parsed by the
standard library so the checks below read the same tree), and its shape: a quantifier nested inside
another repeated group (`(a+)+`, `(\\w{1,9}){1,9}`) is refused, and so is any unbounded repetition
(`+`, `*`, `{n,}`), because a streamed answer's hold-back window is built from the longest match a
pattern can make (`max_match_chars` ≤ 1024): write `\\s{1,5}` instead of `\\s+`. A pattern that
matches the empty string is refused too. What these checks cannot see (an alternation under a
bounded repeat, e.g. `(a|aa){1,40}`, is still exponential) is cut by the timeout: a scan that runs
past SCAN_TIMEOUT_S fails closed, reporting the whole text as one DENY_PATTERN finding.
"""

from __future__ import annotations

import re
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]
from typing import Any

import regex

from ._detectors import DetectorConfigError, Finding

MAX_PATTERN_CHARS = 512
MAX_MATCH_CHARS = 1024
SCAN_TIMEOUT_S = 0.01
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}


def _children(op: Any, av: Any) -> list[Any]:
    """The subpatterns directly under one parsed node (groups, alternatives, lookarounds)."""
    if op == sre.SUBPATTERN:
        return [av[-1]]
    if op == sre.BRANCH:
        return list(av[1])
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return [av[1]]
    return []


def _nests_repeat(items: Any, inside_repeat: bool) -> bool:
    """Whether a parsed subpattern puts a quantifier inside a repeated group."""
    for op, av in items:
        if op in _REPEATS:
            repeats = av[1] > 1
            if (repeats and inside_repeat) or _nests_repeat(av[2], inside_repeat or repeats):
                return True
        elif any(_nests_repeat(child, inside_repeat) for child in _children(op, av)):
            return True
    return False


def pattern_width(pattern: str) -> tuple[int, int]:
    """The shortest and longest text `pattern` (Python `re` syntax) can match; re.error when invalid."""
    lo, hi = _parser.parse(pattern).getwidth()
    return int(lo), int(hi)


def check_pattern(pattern: str) -> int:
    """The longest match `pattern` can make; DetectorConfigError when it is not a safe deny-list pattern."""
    if not pattern:
        raise DetectorConfigError("pattern: empty")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise DetectorConfigError(f"pattern: {len(pattern)} characters, at most {MAX_PATTERN_CHARS}")
    try:
        parsed = _parser.parse(pattern)
    except re.error as e:
        raise DetectorConfigError(f"pattern: invalid regex: {e}") from None
    if _nests_repeat(list(parsed), False):
        raise DetectorConfigError("pattern: a quantifier inside a repeated group (like '(a+)+') can backtrack "
                                  "catastrophically; rewrite it without nesting")
    lo, hi = parsed.getwidth()
    if hi >= MAX_MATCH_CHARS:
        unbounded = hi >= sre.MAXREPEAT - 1
        why = "has unbounded repetition ('+', '*' or '{n,}'); bound it, e.g. '\\s{1,5}'" if unbounded \
            else f"can match {hi} characters"
        raise DetectorConfigError(f"pattern: {why} (a match must fit in {MAX_MATCH_CHARS} characters)")
    if lo == 0:
        raise DetectorConfigError("pattern: matches the empty string")
    return int(hi)


class RegexDetector:
    """Finds every match of one operator pattern, reported as DENY_PATTERN."""

    kind = "regex"

    def __init__(self, pattern: str) -> None:
        self.max_match_chars = check_pattern(pattern)
        try:
            self._compiled = regex.compile(pattern)
        except regex.error as e:
            raise DetectorConfigError(f"pattern: invalid regex: {e}") from None

    def scan(self, text: str) -> list[Finding]:
        try:
            spans = [m.span() for m in self._compiled.finditer(text, timeout=SCAN_TIMEOUT_S)]
        except TimeoutError:
            return [Finding("regex", "DENY_PATTERN", 0, len(text))]  # fail closed: no proof of absence
        return [Finding("regex", "DENY_PATTERN", s, e) for s, e in spans if e > s]
