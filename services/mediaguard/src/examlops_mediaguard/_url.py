"""A strict parser for remote media URLs: a narrow, canonical subset of http(s), nothing lenient.

The danger with media URLs is not one bad parser but two parsers that disagree: the validator
reads ``http://evil.com\\@example.com`` as example.com while the fetcher connects to evil.com.
So this parser does not interpret anything another parser might read differently. It refuses
backslashes, ``@``, fragments, whitespace, percent-encoded, non-ASCII and punycode hosts, IP
literals and trailing dots, and it returns a URL re-serialised from the parts it checked, so the
fetcher is handed a string every mainstream parser splits the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from ._errors import (
    DOMAIN_NOT_ALLOWED,
    IP_LITERAL_NOT_ALLOWED,
    PORT_NOT_ALLOWED,
    URL_MALFORMED,
    USERINFO_NOT_ALLOWED,
    PartRefused,
    shorten,
)

#: Longest http(s) or file URL accepted; data: URLs are bounded by size instead.
MAX_URL_CHARS: Final = 4096
MAX_HOST_CHARS: Final = 253

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,15}:")
# Printable ASCII except space and backslash: anything else is refused before parsing.
_PRINTABLE = re.compile(r"[!-\[\]-~]*\Z")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
# A last label WHATWG would parse as an IPv4 number: decimal, octal (leading 0) or 0x-hex.
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)\Z")
# RFC 3986 pchar without "@" (refused earlier), plus "/" for paths and "?" for queries.
_PATH = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:/]|%[0-9A-Fa-f]{2})*\Z")
_QUERY = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:/?]|%[0-9A-Fa-f]{2})*\Z")

_DEFAULT_PORT: Final = {"http": "80", "https": "443"}


def split_scheme(url: str) -> str:
    """The URL's scheme in lower case; raises when there is none (relative or padded URLs)."""
    match = _SCHEME.match(url)
    if match is None:
        raise PartRefused(URL_MALFORMED, f"not an absolute URL with a scheme: {shorten(url)}")
    return match.group()[:-1].lower()


def check_characters(url: str) -> None:
    """Refuse the characters parsers disagree about before any of them gets to split the URL."""
    if len(url) > MAX_URL_CHARS:
        raise PartRefused(URL_MALFORMED, f"URL longer than {MAX_URL_CHARS} characters")
    if _PRINTABLE.match(url):
        return
    if "\\" in url:
        raise PartRefused(URL_MALFORMED, f"backslash in URL: {shorten(url)}")
    if not url.isascii():
        raise PartRefused(URL_MALFORMED, f"non-ASCII character in URL: {shorten(url)}")
    raise PartRefused(URL_MALFORMED, f"whitespace or control character in URL: {shorten(url)}")


def normalise_domains(domains: Iterable[str]) -> tuple[str, ...]:
    """Allow-list entries in the form hosts are compared in; unusable entries match nothing."""
    out: list[str] = []
    for entry in domains:
        domain = entry.strip().lower().rstrip(".")
        labels = domain.split(".")
        if domain and all(_LABEL.match(label) for label in labels):
            out.append(domain)
    return tuple(out)


def host_allowed(host: str, domains: tuple[str, ...]) -> bool:
    """True when ``host`` is one of ``domains`` or a subdomain of one."""
    return any(host == d or host.endswith("." + d) for d in domains)


def check_remote_url(url: str, scheme: str, domains: tuple[str, ...]) -> str:
    """Validate an http(s) URL (characters already checked) and return its canonical form."""
    if "#" in url:
        raise PartRefused(URL_MALFORMED, f"fragment in URL: {shorten(url)}")
    if "@" in url:
        # Only the authority can hold userinfo, but not every parser agrees where the authority
        # ends (``http://example.com?@evil.com``), so an "@" anywhere is refused.
        raise PartRefused(USERINFO_NOT_ALLOWED, f"'@' in URL: {shorten(url)}")
    rest = url[len(scheme) + 1 :]
    if not rest.startswith("//"):
        raise PartRefused(URL_MALFORMED, f"expected '//' after '{scheme}:': {shorten(url)}")
    rest = rest[2:]
    end = len(rest)
    for delimiter in "/?":
        index = rest.find(delimiter)
        if index != -1:
            end = min(end, index)
    authority, tail = rest[:end], rest[end:]
    host, port = _split_authority(authority, url)
    host = _check_host(host, url)
    if not host_allowed(host, domains):
        raise PartRefused(DOMAIN_NOT_ALLOWED, f"host {host!r} is not an allowed media domain")
    if port is not None and port != _DEFAULT_PORT[scheme]:
        raise PartRefused(PORT_NOT_ALLOWED, f"port {port!r} is not the default {scheme} port")
    path, _, query = tail.partition("?")
    if not _PATH.match(path):
        raise PartRefused(URL_MALFORMED, f"character not allowed in URL path: {shorten(path)}")
    if not _QUERY.match(query):
        raise PartRefused(URL_MALFORMED, f"character not allowed in URL query: {shorten(query)}")
    canonical = f"{scheme}://{host}{path or '/'}"
    return f"{canonical}?{query}" if query else canonical


def _split_authority(authority: str, url: str) -> tuple[str, str | None]:
    if not authority:
        raise PartRefused(URL_MALFORMED, f"URL has no host: {shorten(url)}")
    if authority.startswith("["):
        raise PartRefused(IP_LITERAL_NOT_ALLOWED, f"IPv6 literal host: {shorten(authority)}")
    if "%" in authority:
        raise PartRefused(URL_MALFORMED, f"percent-encoded host: {shorten(authority)}")
    host, colon, port = authority.partition(":")
    if ":" in port or "[" in authority or "]" in authority:
        raise PartRefused(URL_MALFORMED, f"malformed host: {shorten(authority)}")
    if colon and not port:
        raise PartRefused(PORT_NOT_ALLOWED, f"empty port: {shorten(authority)}")
    return host, (port if colon else None)


def _check_host(raw_host: str, url: str) -> str:
    """Lower-case ``raw_host`` and return it if it is a plain DNS name; refuse anything else."""
    host = raw_host.lower()
    if not host:
        raise PartRefused(URL_MALFORMED, f"URL has no host: {shorten(url)}")
    if host.endswith("."):
        raise PartRefused(URL_MALFORMED, f"trailing dot in host: {shorten(raw_host)}")
    if len(host) > MAX_HOST_CHARS:
        raise PartRefused(URL_MALFORMED, f"host longer than {MAX_HOST_CHARS} characters")
    labels = host.split(".")
    if _NUMERIC_LABEL.match(labels[-1]):
        # WHATWG parses any host whose last label is a number as IPv4 (127.1, 0x7f.1,
        # 2130706433, 0177.0.0.1); none of those is a name we could allow.
        raise PartRefused(IP_LITERAL_NOT_ALLOWED, f"IP address host: {shorten(raw_host)}")
    for label in labels:
        if not _LABEL.match(label):
            raise PartRefused(URL_MALFORMED, f"host is not a valid DNS name: {shorten(raw_host)}")
        if label.startswith("xn--"):
            raise PartRefused(URL_MALFORMED, f"punycode host label: {shorten(raw_host)}")
    return host
