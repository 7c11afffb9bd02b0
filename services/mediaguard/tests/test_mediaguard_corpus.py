"""Every hostile input in the corpus is refused with its expected code; every allowed one passes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from examlops.engine import MultimodalPolicy
from examlops_mediaguard._validate import REJECTION_CODES, MediaRejected, validate_messages
from examlops_testsupport.media_corpus import (
    ALLOWED,
    HOSTILE,
    HOSTILE_REQUESTS,
    PART_INDEX,
    PART_PARAM,
    POLICY_KWARGS,
    Allowed,
    Corpus,
    Hostile,
    corpus,
    make_media_root,
    request,
)

POLICY = MultimodalPolicy(**POLICY_KWARGS)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Corpus, MultimodalPolicy]:
    root = make_media_root(tmp_path_factory.mktemp("corpus"))
    entries = corpus(root)
    return entries, MultimodalPolicy(**entries.policy_kwargs)


def _forwarded_url(forwarded: Any) -> str | None:
    if not isinstance(forwarded, dict) or forwarded.get("type") != "image_url":
        return None
    url = forwarded["image_url"]["url"]
    assert isinstance(url, str)
    return url


def _assert_refused(part: Any, code: str, policy: MultimodalPolicy) -> None:
    with pytest.raises(MediaRejected) as caught:
        validate_messages(request(part), policy)
    assert (caught.value.code, caught.value.param) == (code, PART_PARAM), caught.value.message
    assert caught.value.part_index == PART_INDEX


def _assert_accepted(part: Any, expected: str | None, policy: MultimodalPolicy) -> None:
    result = validate_messages(request(part), policy)
    forwarded = result.messages[0]["content"][1]
    assert _forwarded_url(forwarded) == expected
    assert result.counts == ({"image": 1} if expected else {})
    # The forwarded form is a fixed point: validating it again changes nothing.
    assert validate_messages(result.messages, policy).messages == result.messages


def _ids(entries: list[Hostile]) -> list[str]:
    return [f"{cls}-{i}" for i, (cls, _, _) in enumerate(entries)]


@pytest.mark.parametrize(("cls", "part", "code"), HOSTILE, ids=_ids(HOSTILE))
def test_hostile_part_is_refused_with_its_code(cls: str, part: Any, code: str) -> None:
    _assert_refused(part, code, POLICY)


@pytest.mark.parametrize(("part", "expected"), ALLOWED, ids=[str(i) for i in range(len(ALLOWED))])
def test_allowed_part_is_forwarded_in_canonical_form(part: Any, expected: str | None) -> None:
    _assert_accepted(part, expected, POLICY)


@pytest.mark.parametrize(("cls", "messages", "code", "param"), HOSTILE_REQUESTS)
def test_hostile_request_is_refused_at_the_right_part(cls: str, messages: list[Any], code: str, param: str) -> None:
    with pytest.raises(MediaRejected) as caught:
        validate_messages(messages, POLICY)
    assert (caught.value.code, caught.value.param) == (code, param)


def test_local_file_corpus(local: tuple[Corpus, MultimodalPolicy]) -> None:
    entries, policy = local
    hostile: list[Hostile] = entries.hostile
    allowed: list[Allowed] = entries.allowed
    assert len(hostile) >= 25 and len(allowed) >= 8
    failures: list[str] = []
    for cls, part, code in hostile:
        try:
            _assert_refused(part, code, policy)
        except (AssertionError, pytest.fail.Exception) as exc:
            failures.append(f"{cls} {part}: {exc}")
    for part, expected in allowed:
        try:
            _assert_accepted(part, expected, policy)
        except (AssertionError, MediaRejected) as exc:
            failures.append(f"allowed {part}: {exc!r}")
    assert failures == []


def test_accepted_remote_urls_mean_the_same_to_the_fetchers_parsers() -> None:
    for part, expected in ALLOWED:
        if expected is None or not expected.startswith("http"):
            continue
        split, url = urlsplit(expected), httpx.URL(expected)
        assert split.hostname == url.host == urlsplit(expected).netloc
        assert split.hostname is not None and split.hostname.endswith("example.com")
        assert str(url) == expected, part


def test_corpus_is_large_and_exercises_every_code(tmp_path: Path) -> None:
    local_entries = corpus(make_media_root(tmp_path))
    classes = Counter(cls for cls, _, _ in HOSTILE + local_entries.hostile)
    classes.update(cls for cls, _, _, _ in HOSTILE_REQUESTS)
    assert sum(classes.values()) >= 70
    assert all(count >= 1 for count in classes.values())
    codes = {code for _, _, code in HOSTILE + local_entries.hostile}
    codes |= {code for _, _, code, _ in HOSTILE_REQUESTS}
    # Where a host points is asked of DNS after this pure validation (test_mediaguard_service.py).
    assert codes == REJECTION_CODES - {"media_private_address"}
