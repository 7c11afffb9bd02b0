"""Secrets never reach logs: one helper masks them in settings errors, log lines and exit messages."""

from __future__ import annotations

import logging
import re

#: A setting whose name ends so holds a secret (as does every SecretStr setting): never shown, only its length.
SECRET_NAME = re.compile(r"(KEY|TOKEN|TOKENS|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)
#: `scheme://user:password@` anywhere in a text (Redis, database and proxy URLs).
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@")
MASK = "***"


def redact(text: str) -> str:
    """`text` with the password of every URL in it masked: redis://:***@host:6379/0."""
    return _URL_PASSWORD.sub(rf"\g<1>{MASK}@", text)


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
