"""Cache policies as operators meet them: `exa gateway cache` sets, shows, removes and flushes them,
every change is in the audit trail, a key's own policy wins over its endpoint's, `stats` sums what
the gateway did, and a refused change (bad threshold, unknown mode, unknown model) changes nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx

from examlops_testsupport.cache import ask, cache_cli, issue, key_id, stored
from examlops_testsupport.fixtures import RedisServer, Stack, wait_until
from examlops_testsupport.guardrails import ADMIN, register_echo


def _policies(stack: Stack) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = cache_cli(stack, "show")
    return rows


def _audit(stack: Stack, target: str) -> list[dict[str, Any]]:
    out = stack.cli("--json", "audit", "list", "--target", target)
    assert out.returncode == 0, out.stderr
    return [e for e in json.loads(out.stdout) if str(e["action"]).startswith("cache.")]


def test_policies_round_trip_through_the_cli_and_are_audited(stack: Stack, redis_server: RedisServer) -> None:
    stack.register("c-adm-embed", engine="echo", engine_block_json=json.dumps({"engine": "echo", "task": "embed"}))
    register_echo(stack, "c-adm")
    wait_until(lambda: {"id": "c-adm-embed", "task": "embed"}.items() <= next(
        (m for m in httpx.get(stack.gateway_url + "/v1/models", headers=ADMIN).json()["data"]
         if m["id"] == "c-adm-embed"), {}).items(), 10, what="the embedding route reaches the gateway")
    (row,) = cache_cli(stack, "set", "--model", "c-adm", "--mode", "semantic", "--embedding-model", "c-adm-embed",
                       "--threshold", "0.9", "--ttl", "120", "--scope", "project", "--sampled")
    assert row == {"model": "c-adm", "mode": "semantic", "key_id": "", "embedding_model": "c-adm-embed",
                   "threshold": 0.9, "ttl_s": 120, "scope": "project", "sampled": True}, row
    assert row in _policies(stack)
    table = stack.cli("gateway", "cache", "show")
    assert "c-adm" in table.stdout and "semantic" in table.stdout and "c-adm-embed" in table.stdout
    key = issue(stack, "c-adm")
    cache_cli(stack, "set", "--model", "c-adm", "--mode", "exact", "--key", key_id(key))
    assert ask(key, "c-adm", "my own policy", stack.gateway_url)[1] == "miss"
    wait_until(lambda: stored(redis_server, "c-adm") == 1, 5, what="the key's exact answer is kept")
    assert ask(key, "c-adm", "my own policy", stack.gateway_url)[1] == "hit-exact"  # the key's policy wins
    wait_until(lambda: any(r["model"] == "c-adm" and r["mode"] == "exact" and r["hit-exact"] == 1
                           for r in cache_cli(stack, "stats")["data"]), 5, what="the stats count the hit")
    stats = next(r for r in cache_cli(stack, "stats")["data"] if r["model"] == "c-adm" and r["mode"] == "exact")
    assert stats["miss"] == 1 and stats["store"] == 1 and stats["entries"] == 1, stats
    assert "c-adm" in stack.cli("gateway", "cache", "stats").stdout

    flushed = cache_cli(stack, "flush", "--model", "c-adm")
    assert flushed["deleted"] == 1 and stored(redis_server, "c-adm") == 0
    assert ask(key, "c-adm", "my own policy", stack.gateway_url)[1] == "miss"
    assert cache_cli(stack, "unset", "--model", "c-adm", "--key", key_id(key))["removed"] is True
    assert cache_cli(stack, "set", "--model", "c-adm", "--mode", "off")["removed"] is True
    assert not [r for r in _policies(stack) if r["model"] == "c-adm"]
    assert "x-examlops-cache" not in ask(key, "c-adm", "no policy", stack.gateway_url)[1]

    events = _audit(stack, "cache:c-adm")
    assert sorted(e["action"] for e in events) == ["cache.flush", "cache.set", "cache.unset"], events
    assert all(e["actor"] for e in events)
    (key_event, *_) = _audit(stack, f"cache:c-adm/key:{key_id(key)}")
    assert key_event["action"] in ("cache.set", "cache.unset")
    assert '"semantic"' in str(next(e for e in events if e["action"] == "cache.set")["after_json"])


def test_bad_policies_are_refused_clearly_and_change_nothing(stack: Stack) -> None:
    register_echo(stack, "c-bad")
    cache_cli(stack, "set", "--model", "c-bad", "--mode", "exact", "--ttl", "60")
    before = _policies(stack)
    audited = len(_audit(stack, "cache:c-bad"))
    cases = [
        (("--model", "c-bad", "--mode", "semantic", "--threshold", "2"), "threshold"),
        (("--model", "c-bad", "--mode", "fuzzy"), "mode"),
        (("--model", "no-such-model", "--mode", "exact"), "no-such-model"),
        (("--model", "c-bad", "--mode", "exact", "--ttl", "0"), "ttl_s"),
        (("--model", "c-bad", "--mode", "exact", "--scope", "world"), "scope"),
        (("--model", "c-bad", "--mode", "semantic", "--embedding-model", "c-bad"), "embedding_model"),
        (("--model", "c-bad", "--mode", "exact", "--key", "nokey0000000"), "key"),
    ]
    for args, named in cases:
        out = stack.cli("gateway", "cache", "set", *args)
        said = out.stderr + out.stdout
        assert out.returncode != 0 and named in said, (args, said)
    assert _policies(stack) == before
    assert len(_audit(stack, "cache:c-bad")) == audited
