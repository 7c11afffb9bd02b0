"""Fuzz: whatever URL the validator accepts, the fetcher's parsers see an allowed host, no userinfo.

The generated URLs mix parser-differential material (``@``, ``\\``, ``%``, ``:``, brackets,
fullwidth dots, tabs, digits and hex) into scheme, userinfo, host, port and path, so a good share
are near-misses of the allowed form. Acceptance is checked against both ``urllib.parse.urlsplit``
and ``httpx.URL``, the two views a Python fetcher takes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examlops.engine import MultimodalPolicy
from examlops_mediaguard._validate import REJECTION_CODES, MediaRejected, validate_messages

ALLOWED_DOMAINS = ("example.com", "img.example.org")
POLICY = MultimodalPolicy(
    modality="vision",
    limit_mm_per_prompt={"image": 1},
    allowed_media_domains=list(ALLOWED_DOMAINS),
)
NOISE = "abcdexmplEXAMPLor0123456789.-_@\\%:[]/?#~ \t\n\u3002\uff0e\uff45\u0430\u200b"

schemes = st.sampled_from(["http", "https", "HTTP", "hTTps", "ftp", "file", "data", "javascript"])
separators = st.sampled_from(["//", "//", "//", "/", "\\\\", "///", "", "/\\", "\\/"])
userinfo = st.one_of(
    st.just(""),
    st.just(""),
    st.sampled_from(["@", "user@", "a:b@", "example.com@", "evil.com@", "%40@"]),
    st.text(NOISE, max_size=6).map(lambda s: s + "@"),
)
labels = st.one_of(
    st.sampled_from(["example", "com", "img", "org", "evil", "notexample", "EXAMPLE", "xn--e"]),
    st.sampled_from(["127", "0", "1", "0x7f", "0177", "2130706433", "", "localhost", "[::1]"]),
    st.text(NOISE, max_size=8),
)
hosts = st.one_of(
    st.sampled_from([*ALLOWED_DOMAINS, "a.example.com", "EXAMPLE.COM", "example.com.evil.net"]),
    st.lists(labels, min_size=1, max_size=5).flatmap(
        lambda parts: st.sampled_from([".", ".", "\u3002", "@", "\\", ":", "%2e"]).map(lambda dot: dot.join(parts))
    ),
)
ports = st.one_of(
    st.just(""),
    st.sampled_from([":80", ":443", ":", ":080", ":8080", ":80@evil.com"]),
    st.integers(min_value=-1, max_value=70000).map(lambda p: f":{p}"),
)
tails = st.one_of(
    st.just(""),
    st.sampled_from(["/a.png", "/?@evil.com", "#@evil.com", "\\@evil.com", "/%2e%2e/x", "?x=1"]),
    st.text(NOISE, max_size=12).map(lambda s: "/" + s),
)
structured = st.builds(
    lambda scheme, sep, user, host, port, tail: f"{scheme}:{sep}{user}{host}{port}{tail}",
    schemes,
    separators,
    userinfo,
    hosts,
    ports,
    tails,
)
valid = st.builds(
    lambda scheme, sub, host, tail: f"{scheme}://{sub}{host}{tail}",
    st.sampled_from(["http", "https", "HTTP", "hTTps"]),
    st.one_of(st.just(""), st.from_regex(r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,8}[a-zA-Z0-9])?\.", fullmatch=True)),
    st.sampled_from([*ALLOWED_DOMAINS, "EXAMPLE.COM", "Img.Example.Org"]),
    st.one_of(
        st.sampled_from(["", "/", "/a.png", "/x/y.jpg?z=1&w=%2F", "?q", "/a:b;c"]),
        st.text("abcXYZ019-._~!$&'()*+,;=:/?%", max_size=12).map(lambda s: "/" + s),
    ),
)


@st.composite
def near_misses(draw: st.DrawFn) -> str:
    """A valid URL with a few characters inserted or overwritten: the differential-bug zone."""
    url = draw(valid)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        at = draw(st.integers(min_value=0, max_value=len(url)))
        noise = draw(st.text(NOISE + "0x.:@", min_size=1, max_size=3))
        cut = draw(st.integers(min_value=0, max_value=1))
        url = url[:at] + noise + url[at + cut :]
    return url


urls = st.one_of(valid, valid, near_misses(), near_misses(), structured, st.text(max_size=40))


def _allowed(host: str | None) -> bool:
    return host is not None and any(host == d or host.endswith("." + d) for d in ALLOWED_DOMAINS)


def _validate(url: str) -> str | None:
    """The URL forwarded for an image part, or None when the validator refuses it."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    try:
        result = validate_messages([{"role": "user", "content": [part]}], POLICY)
    except MediaRejected as rejected:
        assert rejected.code in REJECTION_CODES
        return None
    forwarded = result.messages[0]["content"][0]["image_url"]["url"]
    assert isinstance(forwarded, str)
    return forwarded


def test_accepted_urls_reach_only_allowed_hosts() -> None:
    accepted: list[str] = []

    @settings(
        max_examples=4000,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(urls)
    def check(url: str) -> None:
        forwarded = _validate(url)
        if forwarded is None:
            return
        accepted.append(forwarded)
        split = urlsplit(forwarded)
        assert split.scheme in ("http", "https")
        assert split.username is None and split.password is None and "@" not in split.netloc
        assert split.port is None and not split.fragment
        assert _allowed(split.hostname), forwarded
        parsed = httpx.URL(forwarded)
        assert parsed.userinfo == b"" and parsed.port is None
        assert _allowed(parsed.host), forwarded
        assert parsed.host == split.hostname
        # Even the caller's original spelling names the same host to both parsers.
        assert _allowed(httpx.URL(url).host) and _allowed(urlsplit(url).hostname), url
        # The forwarded form is canonical: validating it again returns it unchanged.
        assert _validate(forwarded) == forwarded

    check()
    # A fuzz run that never reaches acceptance proves nothing.
    assert len(set(accepted)) >= 250, len(set(accepted))


@settings(max_examples=1500, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=200))
def test_arbitrary_text_is_either_refused_with_a_known_code_or_an_allowed_url(text: str) -> None:
    forwarded = _validate(text)
    assert forwarded is None or _allowed(urlsplit(forwarded).hostname)
