"""Internal engine addresses reach the admin key only: a virtual-key holder's errors name the endpoint."""

from __future__ import annotations

import json

import httpx
import openai

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, free_port, wait_until

ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}


def _502(stack: Stack, key: str, model: str, stream: bool) -> str:
    c = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)
    try:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=stream)
    except openai.APIStatusError as exc:
        assert exc.status_code == 502 and isinstance(exc.body, dict), exc
        assert exc.body["type"] == "AllBackendsFailed"
        return str(exc.body["message"])
    finally:
        c.close()
    raise AssertionError("the call to a server that is down succeeded")


def test_a_down_backend_shows_its_address_to_the_admin_key_only(stack: Stack) -> None:
    port = free_port()  # nothing listens there
    address = f"127.0.0.1:{port}"
    stack.register("down-backend", engine="vllm-server", base_url=f"http://{address}")
    wait_until(lambda: any(m["id"] == "down-backend" for m in httpx.get(
        stack.gateway_url + "/v1/models", headers=ADMIN).json()["data"]), 10)
    issued = stack.cli("--json", "gateway", "key", "issue", "--tenant", "t", "--project", "p",
                       "--model", "down-backend")
    assert issued.returncode == 0, issued.stderr
    key = json.loads(issued.stdout)["virtual_key"]

    admin_sees = _502(stack, DEFAULT_ADMIN_KEY, "down-backend", stream=False)
    assert "endpoint:down-backend" in admin_sees and address in admin_sees, admin_sees  # the operator's clue
    for stream in (False, True):
        holder_sees = _502(stack, key, "down-backend", stream)
        assert "endpoint:down-backend" in holder_sees, holder_sees
        assert address not in holder_sees and str(port) not in holder_sees and "http" not in holder_sees
