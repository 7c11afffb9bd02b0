"""Helpers of the guardrail tests: policies set with `exa`, keys that carry them, the openai client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from examlops.svc import DEFAULT_ADMIN_KEY

from .fixtures import Stack, wait_until

ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}


def applied(url: str) -> bool:
    """Whether the gateway at `url` applies the policies in Redis (its copy is refreshed every 0.5 s)."""
    listing = httpx.get(url + "/admin/guardrails", headers=ADMIN).json()
    return bool(listing["version"] == listing["applied"])


def guardrail(stack: Stack, *args: str) -> Any:
    """`exa --json gateway guardrail ARGS`, once the gateway applies the change."""
    out = stack.cli("--json", "gateway", "guardrail", *args)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: applied(stack.gateway_url), 5, what="the gateway applies the policies")
    return json.loads(out.stdout) if out.stdout.strip().startswith(("[", "{")) else out.stdout


def set_policy(stack: Stack, name: str, *groups: str) -> dict[str, Any]:
    """`exa gateway guardrail set NAME <groups>` (e.g. "--detector", "pii", "--direction", "input", ...)."""
    rows: list[dict[str, Any]] = guardrail(stack, "set", name, *groups)
    return rows[0]


def issue_key(stack: Stack, model: str, *guardrails: str) -> str:
    args = [a for g in guardrails for a in ("--guardrail", g)]
    out = stack.cli("--json", "gateway", "key", "issue", "--tenant", "t", "--project", "guard", "--model", model,
                    *args)
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["virtual_key"])


def client(stack: Stack, key: str, url: str = "") -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or stack.gateway_url) + "/v1", api_key=key, max_retries=0)


def register_echo(stack: Stack, *names: str) -> None:
    for name in names:
        stack.register(name, engine="echo", project="guard")
    wait_until(lambda: set(names) <= {m["id"] for m in httpx.get(
        stack.gateway_url + "/v1/models", headers=ADMIN).json()["data"]}, 10)


def blocked(call: Any) -> dict[str, Any]:
    """The error body of a call the gateway refused with 400 guardrail_blocked."""
    try:
        call()
    except openai.BadRequestError as exc:
        assert isinstance(exc.body, dict) and exc.body["code"] == "guardrail_blocked", exc.body
        return exc.body | {"header": exc.response.headers.get("x-examlops-guardrails", "")}
    raise AssertionError("the call was not blocked")


def stream_text(c: openai.OpenAI, model: str, text: str, **extra: Any) -> tuple[str, list[str], str]:
    """(the content the client received, the pieces, the error event's code or '')."""
    pieces: list[str] = []
    try:
        for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                               stream=True, extra_body=extra or None):
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
    except openai.APIError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return "".join(pieces), pieces, str(body.get("code") or exc.message)
    return "".join(pieces), pieces, ""
