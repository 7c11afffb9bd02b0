"""Guardrail policies and the input direction, as users meet them: operators set policies with `exa`,
clients call through the gateway with the official openai client, the echo engine shows exactly what
reached it. (The output direction and streams: test_guardrails_output.py.)"""

from __future__ import annotations

import json

import httpx
import redis

from examlops_testsupport.fixtures import RedisServer, Stack, wait_until
from examlops_testsupport.guardrails import (
    ADMIN,
    applied,
    blocked,
    client,
    guardrail,
    issue_key,
    register_echo,
    set_policy,
)

SECRET_ORDER = "ACME-4417"   # what the deny-list pattern matches; must never show in errors or logs
REGEX_BLOCK = ("--detector", "regex", "--pattern", r"ACME-\d{4}", "--direction", "input", "--action", "block")


def _key_row(stack: Stack, key: str) -> dict[str, object]:
    key_id = key.split("-")[2]
    row: dict[str, object] = httpx.get(f"{stack.gateway_url}/admin/keys/{key_id}", headers=ADMIN).json()
    return row


def _last_cost(redis_server: RedisServer, key: str) -> dict[str, str]:
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    (_, fields), = r.xrevrange("{vk:" + key.split("-")[2] + "}:cost", count=1)
    return fields


def test_an_input_block_names_the_message_costs_nothing_and_leaves_no_text_in_logs(
        stack: Stack, redis_server: RedisServer) -> None:
    register_echo(stack, "g-in-block")
    set_policy(stack, "orders", *REGEX_BLOCK)
    key = issue_key(stack, "g-in-block", "orders")
    c = client(stack, key)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                {"role": "user", "content": f"ship order {SECRET_ORDER} today"}]
    err = blocked(lambda: c.chat.completions.create(model="g-in-block", messages=messages))  # type: ignore[arg-type]
    assert err["param"] == "messages[2]", err
    assert "'orders'" in err["message"] and "regex" in err["message"] and "DENY_PATTERN" in err["message"]
    assert SECRET_ORDER not in json.dumps(err)
    assert err["header"] == "orders/regex/DENY_PATTERN/block=1"
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": SECRET_ORDER}]}]
    assert blocked(lambda: c.chat.completions.create(model="g-in-block", messages=parts))["param"] \
        == "messages[0].content[1]"  # type: ignore[arg-type]
    assert blocked(lambda: c.completions.create(model="g-in-block", prompt=["fine", SECRET_ORDER]))["param"] \
        == "prompt[1]"
    row = _key_row(stack, key)
    assert row["spend_micro_usd"] == 0 and row["reserved_micro_usd"] == 0 and row["completion_tokens"] == 0, row
    assert row["requests"] == 3  # each block settled (status 400, nothing charged)
    cost = _last_cost(redis_server, key)
    assert cost["status"] == "400" and cost["guarded"] == "orders/regex/DENY_PATTERN/block=1", cost
    ok = c.chat.completions.create(model="g-in-block", messages=[{"role": "user", "content": "ACME-44"}])
    assert ok.choices[0].message.content == "echo: ACME-44"
    log = (stack.workdir / "gateway.log").read_text()
    assert SECRET_ORDER not in log
    key_id = key.split("-")[2]

    def blocks() -> list[dict[str, object]]:
        out = stack.cli("--json", "audit", "list", "--target", f"key:{key_id}")
        return [e for e in json.loads(out.stdout) if e["action"] == "guardrail.block"]
    wait_until(lambda: len(blocks()) == 3, 10, 0.1, "three guardrail.block audit events")  # the trail flags them
    events = blocks()
    assert SECRET_ORDER not in json.dumps(events)
    assert {e["actor"] for e in events} == {"gateway"}, events
    assert all('"policy":"orders"' in str(e["after_json"]) and "DENY_PATTERN" in str(e["after_json"]) for e in events)


def test_a_redacted_prompt_reaches_the_engine_redacted_for_every_key_of_an_endpoint(stack: Stack) -> None:
    register_echo(stack, "g-in-redact")
    set_policy(stack, "no-email-in", "--detector", "pii", "--entities", "EMAIL_ADDRESS", "--direction", "input",
               "--action", "redact")
    guardrail(stack, "attach", "no-email-in", "--model", "g-in-redact")
    for key in (issue_key(stack, "g-in-redact"), ADMIN["Authorization"].split()[1]):
        resp = client(stack, key).chat.completions.with_raw_response.create(
            model="g-in-redact", messages=[{"role": "user", "content": "write to bob.smith@example.com soon"}])
        assert resp.parse().choices[0].message.content == "echo: write to <EMAIL_ADDRESS> soon"
        assert resp.headers["x-examlops-guardrails"] == "no-email-in/pii/EMAIL_ADDRESS/redact=1"
    guardrail(stack, "detach", "no-email-in", "--model", "g-in-redact")
    plain = client(stack, issue_key(stack, "g-in-redact")).chat.completions.create(
        model="g-in-redact", messages=[{"role": "user", "content": "bob.smith@example.com"}])
    assert plain.choices[0].message.content == "echo: bob.smith@example.com"


def test_log_only_reports_and_counts(stack: Stack) -> None:
    register_echo(stack, "g-in-log")
    set_policy(stack, "watch-keys", "--detector", "secrets", "--direction", "input", "--action", "log")
    key = issue_key(stack, "g-in-log", "watch-keys")
    token = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    resp = client(stack, key).chat.completions.with_raw_response.create(
        model="g-in-log", messages=[{"role": "user", "content": f"token {token}"}])
    assert token in (resp.parse().choices[0].message.content or "")
    fired = resp.headers["x-examlops-guardrails"]
    assert fired.startswith("watch-keys/secrets/") and fired.endswith("/log=1"), fired
    metrics = httpx.get(stack.gateway_url + "/metrics").text
    assert 'examlops_gateway_guardrail_actions_total{action="log",detector="secrets",direction="input",' \
           'policy="watch-keys"} 1.0' in metrics


def test_policies_are_validated_audited_and_refused_for_deletion_while_attached(stack: Stack) -> None:
    bad = stack.cli("gateway", "guardrail", "set", "bad", "--detector", "pii", "--entities", "NOPE",
                    "--direction", "input", "--action", "block")
    assert bad.returncode != 0 and "detectors[0].entities" in bad.stderr + bad.stdout
    unbounded = stack.cli("gateway", "guardrail", "set", "bad", "--detector", "regex", "--pattern", "a+",
                          "--direction", "both", "--action", "block")
    assert unbounded.returncode != 0 and "detectors[0].pattern" in unbounded.stderr + unbounded.stdout
    register_echo(stack, "g-audit")
    set_policy(stack, "audited", *REGEX_BLOCK)
    guardrail(stack, "attach", "audited", "--model", "g-audit")
    in_use = stack.cli("gateway", "guardrail", "delete", "audited")
    assert in_use.returncode != 0 and "endpoint g-audit" in in_use.stderr + in_use.stdout
    guardrail(stack, "detach", "audited", "--model", "g-audit")
    guardrail(stack, "delete", "audited")
    events = json.loads(stack.cli("--json", "audit", "list", "--target", "guardrail:audited").stdout)
    assert {e["action"] for e in events} == {"guardrail.set", "guardrail.attach", "guardrail.detach",
                                             "guardrail.delete"}, events


def test_guardrail_test_prints_what_each_detector_finds(stack: Stack) -> None:
    set_policy(stack, "probe", *REGEX_BLOCK, "--detector", "pii", "--direction", "both", "--action", "redact",
               "--detector", "model", "--route", "no-such-judge", "--direction", "input", "--action", "block")
    text = f"{SECRET_ORDER} to ann@example.org"
    out = stack.cli("gateway", "guardrail", "test", "probe", "--text", text)
    assert out.returncode == 0, out.stderr
    assert "DENY_PATTERN" in out.stdout and "0-9" in out.stdout and "EMAIL_ADDRESS" in out.stdout, out.stdout
    rows = json.loads(stack.cli("--json", "gateway", "guardrail", "test", "probe", "--text", text).stdout)["results"]
    assert rows[2]["skipped"] and not rows[2].get("error")  # no model is called by a test...
    asked = json.loads(stack.cli("--json", "gateway", "guardrail", "test", "probe", "--text", text,
                                 "--run-judges").stdout)["results"]
    assert "JudgeError" in asked[2]["error"]  # ...unless asked to (this judge's route does not exist)
    listing = stack.cli("gateway", "guardrail", "list")
    assert "probe" in listing.stdout and "ACME" in listing.stdout


def test_a_policy_reaches_another_replica_within_a_second(stack: Stack) -> None:
    register_echo(stack, "g-replica")
    _, url = stack.start_gateway_replica("gateway-guard-2")
    wait_until(lambda: applied(url), 5)
    key = issue_key(stack, "g-replica")
    c = client(stack, key, url)
    msg = [{"role": "user", "content": f"order {SECRET_ORDER}"}]
    assert c.chat.completions.create(model="g-replica", messages=msg).choices  # type: ignore[arg-type]
    set_policy(stack, "replicated", *REGEX_BLOCK)
    guardrail(stack, "attach", "replicated", "--model", "g-replica")

    def refused() -> bool:
        try:
            c.chat.completions.create(model="g-replica", messages=msg)  # type: ignore[arg-type]
        except Exception:
            return True
        return False
    took = wait_until(refused, 3, interval_s=0.05, what="the other replica applies the policy")
    assert took < 1.5, took
    assert blocked(lambda: c.chat.completions.create(model="g-replica", messages=msg))["param"] == "messages[0]"  # type: ignore[arg-type]
