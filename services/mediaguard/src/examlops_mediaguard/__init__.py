"""Mediaguard service: validates media parts before any engine call; never fetches media."""

import examlops.grpcenv  # noqa: F401  (first: gRPC core reads its settings when grpc is imported)

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
