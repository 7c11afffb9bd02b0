"""Secrets never reach logs: one helper masks them in settings errors, log lines and exit messages."""

from __future__ import annotations

import logging
import re

from examlops.urlmask import redact

#: A setting whose name ends so holds a secret (as does every SecretStr setting): never shown, only its length.
SECRET_NAME = re.compile(r"(KEY|TOKEN|TOKENS|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)


def redact_setting(name: str, value: object, secret: bool = False) -> str:
    """How a setting's value may be shown in an error: secrets by length only, URLs without passwords."""
    if secret or SECRET_NAME.search(name):
        # a SecretStr's str() is its mask: measure the secret itself
        plain = value.get_secret_value() if hasattr(value, "get_secret_value") else value
        return f"<redacted, {len(str(plain))} characters>"
    return redact(repr(value))


class RedactingFormatter(logging.Formatter):
    """Masks URL passwords in every formatted log line, whatever logged them."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
