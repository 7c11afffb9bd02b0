from __future__ import annotations

from pydantic import SecretStr

from examlops.svc import redact_setting


def test_a_secret_is_shown_by_its_own_length_never_its_value() -> None:
    shown = redact_setting("EXAMLOPS_ADMIN_KEY", SecretStr("exa-dev-admin-key"))
    assert shown == "<redacted, 17 characters>"  # the key's length, not the mask's (10)
    assert "exa-dev" not in shown
    assert redact_setting("EXAMLOPS_SERVICE_TOKEN", "t" * 40) == "<redacted, 40 characters>"


def test_a_url_keeps_everything_but_its_password() -> None:
    assert redact_setting("EXAMLOPS_REDIS_URL", "redis://:hunter2@db:6379/0") == "'redis://:***@db:6379/0'"
