"""The `pii` detector: Microsoft Presidio's predefined pattern recognizers, with no NLP engine.

Presidio's AnalyzerEngine would load a spaCy model (and download one when missing); the pattern
recognizers do not need it: each is called with `nlp_artifacts=None`, which skips only the
context-word score boost. So email, phone (the `phonenumbers` library), credit card (Luhn
checksum), IBAN (checksum), IP address (IPv4 and IPv6, parsed) and US SSN (with Presidio's
invalid-number rules) all work offline. PERSON needs a spaCy NER model: it is offered only when
`en_core_web_sm`/`_md`/`_lg` is installed, and never downloaded. Presidio's email recognizer checks
the domain with tldextract, whose default fetches the public-suffix list over the network on first
use: here it is replaced by one built from tldextract's bundled snapshot.

Presidio's phone recognizer runs `phonenumbers`' matcher over the whole text once per region
(~9 ms on a 2 KB prompt); here it runs only on windows around phone-shaped candidates (7 to 15
digits with the usual separators, not ISO dates; a `+` number is parsed once, not once per
region), ~0.5 ms, with `phonenumbers`' STRICT_GROUPING leniency (digit
groups must follow the region's format: drops ISBNs, dates, netmasks, order numbers). A number
written as bare digits (no `+`, no separator) is a phone only after a context word (phone, call,
tel, mobile, …) in the 40 characters before it: bare digit runs are mostly order, tracking and
account numbers. Presidio's context enhancement needs the NLP engine; this is its cheap stand-in.

Among the findings, one strictly inside a longer one is dropped (a Luhn-valid run inside an IBAN
is not a card), and an IPv4 address that is part of a longer dotted number (`10.0.0.0.1`) is not one.

A finding needs Presidio's score ≥ MIN_SCORE (after checksum validation), which drops checksum
failures (score 0) and the "very weak" SSN patterns (nine bare digits, `12345-6789`): those are
mostly order and account numbers, and count only after a context word (SSN, social security) in the
40 characters before them. Presidio's card patterns miss Mastercard's 2221-2720 range; one pattern
is added for it (validated by the same Luhn check).
"""

from __future__ import annotations

import gc
import importlib.util
import re
from collections.abc import Callable
from typing import Any

from ._detectors import Finding

MIN_SCORE = 0.4
SPACY_MODELS = ("en_core_web_lg", "en_core_web_md", "en_core_web_sm")
PATTERN_ENTITIES = ("EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "IBAN_CODE", "IP_ADDRESS", "US_SSN")
# The longest text one finding can span: an email address (RFC 5321: 254), the rest are shorter.
MAX_CHARS = {"EMAIL_ADDRESS": 254, "PHONE_NUMBER": 32, "CREDIT_CARD": 24, "IBAN_CODE": 42,
             "IP_ADDRESS": 45, "US_SSN": 11, "PERSON": 64}


PHONE_CANDIDATE = re.compile(r"(?<![\w+])\+?\(?\d[\d \t().\-/]{5,22}\d(?!\w)")
WARM_UP = ("a@example.com +1 415 555 0132, (212) 555-0123, 020 7946 0958, 030 901820, 01 42 68 53 00, 03-623-4567, "
           "098765 43210, (11) 91234-5678, 0042-7781, 4111 1111 1111 1111 DE89370400440532013000 10.0.0.1 ::1")
PHONE_CONTEXT = re.compile(r"(?i)\b(?:phone|call|tel|telephone|mobile|cell|fax|sms|whatsapp|text me|ring)\b")
SSN_CONTEXT = re.compile(r"(?i)\b(?:ssn|ss#|social security|social sec)")
MASTERCARD_2_SERIES = r"\b2(?:2[2-9]\d|[3-6]\d\d|7[01]\d|720)[- ]?\d{4}[- ]?\d{4}[- ]?\d{4}\b"
ISO_DATE = re.compile(r"\d{4}-\d\d-\d\d\b")
DOTTED_NEIGHBOUR = re.compile(r"\d\.$|^\.\d")


def _spacy_model() -> str | None:
    return next((m for m in SPACY_MODELS if importlib.util.find_spec(m) is not None), None)


PII_ENTITIES = PATTERN_ENTITIES + (("PERSON",) if _spacy_model() else ())


def _recognizers(entities: tuple[str, ...]) -> list[Any]:
    import tldextract
    from presidio_analyzer import Pattern
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        IbanRecognizer,
        IpRecognizer,
        PhoneRecognizer,
        UsSsnRecognizer,
    )

    offline_suffixes = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None, fallback_to_snapshot=True)

    class OfflineEmailRecognizer(EmailRecognizer):
        def validate_result(self, pattern_text: str) -> bool:
            return offline_suffixes(pattern_text).fqdn != ""

    international = PhoneRecognizer(supported_regions=("US",), leniency=2)   # a `+` number needs no region

    class CandidatePhoneRecognizer(PhoneRecognizer):
        def analyze(self, text: str, entities: list[str], nlp_artifacts: Any = None) -> list[Any]:
            results = []
            for m in PHONE_CANDIDATE.finditer(text):
                candidate = m.group()
                if not 7 <= sum(c.isdigit() for c in candidate) <= 15 or ISO_DATE.match(candidate) or (
                        candidate.isdigit() and not PHONE_CONTEXT.search(text, max(0, m.start() - 40), m.start())):
                    continue
                start = max(0, m.start() - 1)
                window = text[start:m.end() + 1]
                found = international.analyze(window, entities, nlp_artifacts) if candidate.startswith("+") \
                    else super().analyze(window, entities, nlp_artifacts)
                for r in found:
                        r.start, r.end = r.start + start, r.end + start
                        results.append(r)
            return results

    card_patterns = [*CreditCardRecognizer.PATTERNS, Pattern("Mastercard 2-series", MASTERCARD_2_SERIES, 0.3)]
    by_entity: dict[str, Callable[[], Any]] = {
        "EMAIL_ADDRESS": OfflineEmailRecognizer, "PHONE_NUMBER": lambda: CandidatePhoneRecognizer(leniency=2),
        "CREDIT_CARD": lambda: CreditCardRecognizer(patterns=card_patterns), "IBAN_CODE": IbanRecognizer,
        "IP_ADDRESS": IpRecognizer, "US_SSN": UsSsnRecognizer}
    return [by_entity[e]() for e in entities if e in by_entity]


def _keep(text: str, entity: str, start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """False for a finding strictly inside a longer one, and for an IPv4 inside a longer dotted number."""
    if any(s <= start and end <= e and e - s > end - start for s, e in spans):
        return False
    return not (entity == "IP_ADDRESS" and (DOTTED_NEIGHBOUR.search(text[max(0, start - 2):start])
                                           or DOTTED_NEIGHBOUR.search(text[end:end + 2])))


class _PersonRecognizer:
    """PERSON from a locally installed spaCy NER model (only offered when one is installed)."""

    def __init__(self, model: str) -> None:
        import spacy
        self._nlp = spacy.load(model, disable=["parser", "lemmatizer"])

    def analyze(self, text: str, entities: list[str], nlp_artifacts: Any) -> list[Any]:
        from presidio_analyzer import RecognizerResult
        return [RecognizerResult("PERSON", e.start_char, e.end_char, 0.85)
                for e in self._nlp(text).ents if e.label_ == "PERSON"]


class PiiDetector:
    """Finds the chosen PII entity types with Presidio's recognizers; thread-safe (no shared mutable state)."""

    kind = "pii"

    def __init__(self, entities: tuple[str, ...]) -> None:
        self.entities = entities
        self.max_match_chars = max(MAX_CHARS[e] for e in entities)
        self._recognizers = _recognizers(entities)
        model = _spacy_model()
        if "PERSON" in entities and model:
            self._recognizers.append(_PersonRecognizer(model))
        self.scan(WARM_UP)   # compile the patterns, load the suffix list and phone metadata now, not on a request
        # Presidio leaves ~190,000 long-lived objects behind: take them out of the collector's generations,
        # or a full collection stops the event loop for ~100 ms (bench/bench_guardrail_detectors.py --no-freeze).
        gc.freeze()

    def scan(self, text: str) -> list[Finding]:
        found: dict[tuple[str, int, int], float] = {}
        for recognizer in self._recognizers:
            for r in recognizer.analyze(text, list(self.entities), None):
                key = (r.entity_type, r.start, r.end)
                if r.entity_type in self.entities and r.score > found.get(key, -1.0) and (r.score >= MIN_SCORE or (
                        r.entity_type == "US_SSN" and r.score > 0
                        and SSN_CONTEXT.search(text, max(0, r.start - 40), r.start))):
                    found[key] = r.score
        spans = [(s, e) for _, s, e in found]
        ordered = sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][2]))
        return [Finding("pii", entity, start, end, score) for (entity, start, end), score in ordered
                if _keep(text, entity, start, end, spans)]

