"""The typed rejection mediaguard raises, and the closed set of codes it can carry.

Every code starts with ``media_`` and names the rule that was broken, not the guess about intent:

=================================  =================================================================
``media_part_malformed``           A message or content part has the wrong shape: no string
                                   ``type``, a URL that is not a string, a ``uuid`` field, or a
                                   media field smuggled into a part of another type.
``media_type_not_allowed``         A part type we refuse (embeddings, PIL objects, files, unknown
                                   types), or a media type the part's kind does not accept
                                   (``text/html``, ``image/svg+xml``, an audio payload in an image).
``media_modality_not_supported``   The endpoint does not serve this kind of media at all.
``media_count_exceeded``           More parts of one kind than ``limit_mm_per_prompt`` allows.
``media_too_large``                An inline payload or local file is larger than
                                   ``max_image_bytes``.
``media_encoding_mismatch``        A payload is not (canonical) base64, or its first bytes are not
                                   the format its declared type promises.
``media_url_malformed``            The URL is outside the strict grammar: whitespace, control or
                                   non-ASCII characters, backslashes, fragments, percent-encoded,
                                   punycode or trailing-dot hosts, a missing ``//``.
``media_scheme_not_allowed``       Anything but http, https, data, and file when a local root is
                                   configured.
``media_userinfo_not_allowed``     An ``@`` anywhere in a remote URL.
``media_ip_literal_not_allowed``   The host is an IP address, in any spelling.
``media_port_not_allowed``         A port other than the scheme's default.
``media_domain_not_allowed``       The host is not an allowed domain nor a subdomain of one.
``media_private_address``          The host resolves to a loopback, private, link-local or other
                                   non-public address (or DNS did not answer in time), and the
                                   policy does not set ``allow_private_addresses``.
``media_path_not_allowed``         A file:// path outside the local root, the root itself, a
                                   missing or non-regular file, or a percent-encoded traversal.
=================================  =================================================================
"""

from __future__ import annotations

from typing import Final

__all__ = ["REJECTION_CODES", "MediaRejected"]

PART_MALFORMED: Final = "media_part_malformed"
TYPE_NOT_ALLOWED: Final = "media_type_not_allowed"
MODALITY_NOT_SUPPORTED: Final = "media_modality_not_supported"
COUNT_EXCEEDED: Final = "media_count_exceeded"
TOO_LARGE: Final = "media_too_large"
ENCODING_MISMATCH: Final = "media_encoding_mismatch"
URL_MALFORMED: Final = "media_url_malformed"
SCHEME_NOT_ALLOWED: Final = "media_scheme_not_allowed"
USERINFO_NOT_ALLOWED: Final = "media_userinfo_not_allowed"
IP_LITERAL_NOT_ALLOWED: Final = "media_ip_literal_not_allowed"
PORT_NOT_ALLOWED: Final = "media_port_not_allowed"
DOMAIN_NOT_ALLOWED: Final = "media_domain_not_allowed"
PRIVATE_ADDRESS: Final = "media_private_address"
PATH_NOT_ALLOWED: Final = "media_path_not_allowed"

#: Every code a `MediaRejected` can carry.
REJECTION_CODES: frozenset[str] = frozenset(
    {
        PART_MALFORMED,
        TYPE_NOT_ALLOWED,
        MODALITY_NOT_SUPPORTED,
        COUNT_EXCEEDED,
        TOO_LARGE,
        ENCODING_MISMATCH,
        URL_MALFORMED,
        SCHEME_NOT_ALLOWED,
        USERINFO_NOT_ALLOWED,
        IP_LITERAL_NOT_ALLOWED,
        PORT_NOT_ALLOWED,
        DOMAIN_NOT_ALLOWED,
        PRIVATE_ADDRESS,
        PATH_NOT_ALLOWED,
    }
)


class MediaRejected(Exception):
    """A request's media broke the endpoint's policy; raised before anything is fetched or sent.

    ``param`` locates the offending part (``messages[0].content[2]``); ``part_index`` is that
    part's index in its message's ``content`` list, or -1 when a whole message is at fault.
    """

    def __init__(self, code: str, message: str, param: str, part_index: int) -> None:
        super().__init__(f"{code}: {message} ({param})")
        self.code = code
        self.message = message
        self.param = param
        self.part_index = part_index

    def __reduce__(self) -> tuple[type[MediaRejected], tuple[str, str, str, int]]:
        return (type(self), (self.code, self.message, self.param, self.part_index))


class PartRefused(Exception):
    """Raised by the per-part checks, which do not know where the part sits in the request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def shorten(value: str, limit: int = 80) -> str:
    """A safe, bounded rendering of caller input for an error message (escapes control chars)."""
    text = repr(value[:limit])
    return text if len(text) <= limit and len(value) <= limit else text[:limit] + "..."
