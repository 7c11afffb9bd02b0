"""The gateway's admin key: the well-known dev key and short keys open only a development stack.

Outside dev mode (EXAMLOPS_DEV_MODE, which `make up` and the tests' stacks set) the gateway process
refuses to start with them, exiting 2 with a line that names EXAMLOPS_ADMIN_KEY and never the key.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import SERVICES
from examlops_testsupport.fixtures import Stack

STRONG_KEY = "adm-" + "Zq7" * 12  # 40 characters
SHORT_KEY = "k" * 31


def gateway_without_dev_mode(admin_key: str | None) -> subprocess.CompletedProcess[str]:
    """The gateway process with no EXAMLOPS_* setting but the admin key (none: the default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXAMLOPS_")}
    if admin_key is not None:
        env["EXAMLOPS_ADMIN_KEY"] = admin_key
    return subprocess.run([sys.executable, "-m", SERVICES["gateway"]], capture_output=True, text=True,
                          timeout=60, env={**env, "EXAMLOPS_PORT": "0"})


@pytest.mark.parametrize("key", [None, DEFAULT_ADMIN_KEY, "k", SHORT_KEY, ""],
                         ids=["unset", "dev-key", "one-char", "31-chars", "empty"])
def test_outside_dev_mode_a_well_known_or_short_key_stops_the_gateway(key: str | None) -> None:
    out = gateway_without_dev_mode(key)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("invalid setting EXAMLOPS_ADMIN_KEY: "), out.stderr
    assert "Traceback" not in out.stderr
    shown = lines[0].removeprefix("invalid setting EXAMLOPS_ADMIN_KEY: ")
    if key in (None, DEFAULT_ADMIN_KEY):  # says why, though the length rule alone would refuse it too
        assert "well-known development key" in shown and "EXAMLOPS_DEV_MODE=1" in shown, shown
    for secret in {DEFAULT_ADMIN_KEY, SHORT_KEY} | ({key} if key and len(key) > 1 else set()):
        assert secret not in shown, "the key was printed"


def _models(url: str, key: str) -> int:
    return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def test_in_dev_mode_the_dev_key_opens_the_gateway(stack: Stack) -> None:
    assert stack.env("gateway")["EXAMLOPS_DEV_MODE"] == "1"  # what `make up` and the fixtures set
    _, url = stack.start_gateway_replica("gateway-dev-key", {"EXAMLOPS_ADMIN_KEY": DEFAULT_ADMIN_KEY})
    assert _models(url, DEFAULT_ADMIN_KEY) == 200
    stack.stop("gateway-dev-key")


def test_outside_dev_mode_a_long_secret_opens_the_gateway_and_the_dev_key_does_not(stack: Stack) -> None:
    _, url = stack.start_gateway_replica("gateway-prod-key", {"EXAMLOPS_DEV_MODE": "0",
                                                               "EXAMLOPS_ADMIN_KEY": STRONG_KEY})
    assert _models(url, STRONG_KEY) == 200
    assert _models(url, DEFAULT_ADMIN_KEY) == 401
    stack.stop("gateway-prod-key")
