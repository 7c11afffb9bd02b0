"""The `secrets` detector: credentials in well-known formats, secret assignments and high-entropy tokens.

Formats (each pattern bounded, so `max_match_chars` is the longest of them): AWS access key ids
(AKIA/ASIA…), GitHub tokens (ghp_/gho_/ghu_/ghs_/ghr_, github_pat_), Slack tokens (xoxa/b/p/r/s-),
Stripe keys (sk_/rk_ live/test), Google API keys (AIza…), OpenAI-style keys (sk-…, sk-proj-…),
JWTs, the BEGIN and END lines of PEM private keys, and the value of a `password=`/`api_key: `
style assignment (not a placeholder such as `YOUR_API_KEY`, `${TOKEN}`, `<secret>` or `****`).

HIGH_ENTROPY flags any other token of 20 to 512 characters from the base64/base64url alphabet that
mixes upper case, lower case and digits and whose Shannon entropy (bits per character) is at
least min(0.82·log2(length), 4.6): random base62 tokens clear it (≥ 99% at every length from 20
up), words, identifiers, paths and version strings do not (they repeat letters or lack a class).
Pure hexadecimal tokens are never HIGH_ENTROPY: in chat they are overwhelmingly git SHAs, digests
and UUIDs; a hex secret is still found in an assignment (`token=9f86d0…`). Base64-encoded data
is flagged (it can carry anything). The body lines of a PEM private key are HIGH_ENTROPY findings,
so a key split over a stream never has a line released. Every 20-character piece of a long
secret is itself such a token, so an output hold-back shorter than `max_match_chars` still never
releases a whole secret (GUARDRAILS.md).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

from ._detectors import Finding
from ._regex import pattern_width

FORMATS = {
    "AWS_ACCESS_KEY": r"\b(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AROA)[A-Z0-9]{16}\b",
    "GITHUB_TOKEN": r"\b(?:gh[pousr]_[A-Za-z0-9]{36,251}|github_pat_[A-Za-z0-9_]{22,244})\b",
    "SLACK_TOKEN": r"\bxox[abprs]-[A-Za-z0-9-]{10,250}",
    "STRIPE_KEY": r"\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,247}\b",
    "GOOGLE_API_KEY": r"\bAIza[0-9A-Za-z_-]{35}(?![\w-])",
    "OPENAI_API_KEY": r"(?<![\w-])sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,200}(?![\w-])",
    "JWT": r"\beyJ[A-Za-z0-9_-]{8,400}\.eyJ[A-Za-z0-9_-]{8,1000}\.[A-Za-z0-9_-]{16,400}",
    "PRIVATE_KEY": r"-----(?:BEGIN|END) (?:[A-Z0-9]{1,12} ){0,3}PRIVATE KEY(?: BLOCK)?-----",
}
ASSIGNMENT = re.compile(
    r"(?i)(?<![a-z])(?:password|passwd|pwd|passphrase|secret|client[_-]?secret|api[_-]?key|apikey|access[_-]?key"
    r"|secret[_-]?key|access[_-]?token|auth[_-]?token|token)[\"']?\s{0,3}[:=]\s{0,3}[\"']?([^\s\"',;]{6,128})")
PLACEHOLDER = re.compile(r"^(?:[A-Z0-9_-]+|\*+|x+|<[^>]*>?|\$\{?\w+\}?|\{\{.*|%\(?\w+.*|\.\.\.)$")
TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{20,512}")   # a longer run is read as 512-character pieces
MAX_LOWER_PAIRS = 0.42
HEX = re.compile(r"^[0-9a-fA-F-]+$")
SECRET_ENTITIES = (*FORMATS, "SECRET_ASSIGNMENT", "HIGH_ENTROPY")


def shannon_entropy(token: str) -> float:
    n = len(token)
    return -sum(c / n * math.log2(c / n) for c in Counter(token).values())


def is_high_entropy(token: str) -> bool:
    """Whether a base64-alphabet token looks random: mixed classes and enough bits per character."""
    if HEX.match(token):
        return False
    if not (any(c.isupper() for c in token) and any(c.islower() for c in token) and any(c.isdigit() for c in token)):
        return False
    if sum(a.islower() and b.islower() for a, b in itertools.pairwise(token)) > MAX_LOWER_PAIRS * (len(token) - 1):
        return False
    return shannon_entropy(token) >= min(0.82 * math.log2(len(token)), 4.6)


class SecretsDetector:
    """Finds the chosen secret entity types; a text position is reported by at most one finding."""

    kind = "secrets"

    def __init__(self, entities: tuple[str, ...]) -> None:
        self.entities = entities
        self._formats = [(e, re.compile(p)) for e, p in FORMATS.items() if e in entities]
        widths = [pattern_width(p)[1] for e, p in FORMATS.items() if e in entities]
        widths += [pattern_width(ASSIGNMENT.pattern)[1]] if "SECRET_ASSIGNMENT" in entities else []
        widths += [pattern_width(TOKEN.pattern)[1]] if "HIGH_ENTROPY" in entities else []
        self.max_match_chars = max(widths)

    def scan(self, text: str) -> list[Finding]:
        found = [Finding("secrets", e, m.start(), m.end()) for e, rx in self._formats for m in rx.finditer(text)]
        if "SECRET_ASSIGNMENT" in self.entities:
            found += [Finding("secrets", "SECRET_ASSIGNMENT", m.start(1), m.end(1), 0.8)
                      for m in ASSIGNMENT.finditer(text)
                      if not PLACEHOLDER.match(m.group(1)) and _free(found, m.start(1), m.end(1))]
        if "HIGH_ENTROPY" in self.entities:
            found += [Finding("secrets", "HIGH_ENTROPY", m.start(), m.end(), 0.6) for m in TOKEN.finditer(text)
                      if _free(found, m.start(), m.end()) and is_high_entropy(m.group())]
        return sorted(found, key=lambda f: (f.start, f.end))


def _free(found: list[Finding], start: int, end: int) -> bool:
    """Whether no finding so far overlaps [start, end): a more specific one wins."""
    return not any(f.start < end and start < f.end for f in found)
