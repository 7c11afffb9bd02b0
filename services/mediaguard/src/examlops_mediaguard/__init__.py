"""Mediaguard service: validates media parts before any engine call; never fetches media."""

from ._validate import (
    REJECTION_CODES,
    MediaRejected,
    ValidatedMessages,
    has_media,
    strip_media,
    validate_messages,
)

__all__ = ["REJECTION_CODES", "MediaRejected", "ValidatedMessages", "has_media", "strip_media",
           "validate_messages"]
