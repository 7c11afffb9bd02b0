"""The governance Lua scripts on a real Redis: admission, reserve/settle exactly once, reaping, GCRA,
and one key check (check_key) shared by reserve.lua and key_models.lua.

These call the scripts as the gateway does (same keys, the same named arguments), without the HTTP
layer, so each rule is checked on its own.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from examlops_gateway.governance import KEY_INDEX, ReserveArgs, SettleArgs, digest, load_script, new_key, redis_keys
from examlops_testsupport.fixtures import RedisServer

TOKEN_PRICE_IN = 2_000_000    # micro-USD per Mtok: 2 micro-USD per prompt token
TOKEN_PRICE_OUT = 10_000_000  # 10 micro-USD per completion token


def _script(r: redis.Redis, name: str) -> Any:
    return load_script(r, name)  # the gateway's own loader (shared prelude + script)


class Scripts:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.reserve_s, self.settle_s, self.reap_s, self.key_models_s = (
            _script(r, n) for n in ("reserve.lua", "settle.lua", "reap.lua", "key_models.lua"))

    def key(self, models: str = ",m,", budget: int = -1, rpm: int = 0, tpm: int = 0,
            expires_ms: int = 0) -> tuple[str, str]:
        key_id, token = new_key()
        self.r.sadd(KEY_INDEX, key_id)
        self.r.hset(redis_keys(key_id)[0], mapping={
            "id": key_id, "hash": digest(token), "tenant": "t", "project": "p", "models": models,
            "budget": budget, "rpm": rpm, "tpm": tpm, "expires_ms": expires_ms, "revoked_ms": 0, "created_ms": 1,
            "spent": 0, "reserved": 0, "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "reaped": 0,
            "rpm_tat": 0, "tpm_tat": 0})
        return key_id, token

    def reserve(self, key_id: str, token: str, prompt: int = 10, asked: int = 0, model: str = "m",
                replica: str = "r1", n: int = 1, priced: bool = True, res_id: str = "") -> tuple[list[str], str]:
        res_id = res_id or secrets.token_hex(8)
        out = self.reserve_s(keys=redis_keys(key_id)[:2], args=self.reserve_args(
            token, prompt=prompt, asked=asked, model=model, replica=replica, n=n, priced=priced, res_id=res_id).argv())
        return out, res_id

    @staticmethod
    def reserve_args(token: str, prompt: int = 10, asked: int = 0, model: str = "m", replica: str = "r1", n: int = 1,
                     priced: bool = True, res_id: str = "") -> ReserveArgs:
        return ReserveArgs(key_hash=digest(token), model=model, res_id=res_id or secrets.token_hex(8),
                           replica_id=replica, prompt_tokens=prompt, prompt_cost=prompt * TOKEN_PRICE_IN,
                           output_rate=n * TOKEN_PRICE_OUT, n=n, max_tokens_asked=asked, default_max_tokens=100,
                           priced=priced, lease_ms=600_000)

    def settle(self, key_id: str, res_id: str, prompt: int, completion: int) -> list[str]:
        cost = -(-(prompt * TOKEN_PRICE_IN + completion * TOKEN_PRICE_OUT) // 1_000_000)
        out: list[str] = self.settle_s(keys=redis_keys(key_id), args=SettleArgs(
            res_id=res_id, cost_micro=cost, prompt_tokens=prompt, completion_tokens=completion, key_id=key_id,
            model="m", status="200", latency_ms=1, ttft_ms=1, stream=False, estimated=False, priced=True,
            trim_ms=0).argv())
        return out

    def key_models(self, key_id: str, token: str) -> list[str]:
        out: list[str] = self.key_models_s(keys=redis_keys(key_id)[:1], args=[digest(token)])
        return out

    def redis_now_ms(self) -> int:
        secs, micros = self.r.time()  # type: ignore[misc]
        return int(secs) * 1000 + int(micros) // 1000

    def reap(self, key_id: str, live: list[str]) -> int:
        return int(self.reap_s(keys=redis_keys(key_id), args=[key_id, 600_000, 0, *live]))

    def fields(self, key_id: str) -> dict[str, str]:
        return self.r.hgetall(redis_keys(key_id)[0])  # type: ignore[return-value]

    def records(self, key_id: str) -> list[dict[str, str]]:
        return [f for _id, f in self.r.xrange(redis_keys(key_id)[2])]  # type: ignore[union-attr]


@pytest.fixture
def s(redis_server: RedisServer) -> Iterator[Scripts]:
    r = redis_server.client()
    yield Scripts(r)
    r.close()


def test_admission_refusals_change_nothing(s: Scripts) -> None:
    key_id, token = s.key(models=",a,b,", budget=1000)
    before = s.fields(key_id)
    assert s.reserve(key_id, token + "x", model="a")[0][:2] == ["deny", "invalid_api_key"]
    assert s.reserve(key_id, token, model="c")[0][:3] == ["deny", "model_not_allowed", ",a,b,"]
    assert s.reserve(key_id, token, model="a", priced=False)[0][:2] == ["deny", "model_not_priced"]
    assert s.reserve(key_id, token, model="a", prompt=600)[0][:2] == ["deny", "budget_exceeded"]
    assert s.fields(key_id) == before and not s.r.exists(redis_keys(key_id)[1])
    unknown, unknown_token = new_key()
    assert s.reserve(unknown, unknown_token)[0][:2] == ["deny", "invalid_api_key"]
    s.r.hset(redis_keys(key_id)[0], "revoked_ms", 5)
    assert s.reserve(key_id, token, model="a")[0][:2] == ["deny", "key_revoked"]
    expired, expired_token = s.key(expires_ms=int(time.time() * 1000) - 1)
    assert s.reserve(expired, expired_token)[0][:2] == ["deny", "key_expired"]


def test_budget_caps_max_tokens_and_reserves_the_bound(s: Scripts) -> None:
    key_id, token = s.key(budget=1000)
    # prompt 10 tokens = 20 micro-USD; 980 left pays for 98 output tokens at 10 each
    out, res_id = s.reserve(key_id, token, prompt=10, asked=500)
    assert out == ["ok", "98", "1000", "t", "p", "1", "", "1"]  # guardrail policies (none); budgeted
    assert s.fields(key_id)["reserved"] == "1000"
    assert s.reserve(key_id, token, prompt=1)[0][:2] == ["deny", "budget_exceeded"]
    s.settle(key_id, res_id, 10, 30)  # 20 + 300
    f = s.fields(key_id)
    assert (f["spent"], f["reserved"], f["requests"]) == ("320", "0", "1")
    # no max_tokens asked: the key's default bound (100 here) is capped to what is left (68)
    out, _ = s.reserve(key_id, token, prompt=0)
    assert out[1:3] == ["68", "680"]


def test_settle_is_exactly_once_and_spend_is_the_sum_of_records(s: Scripts) -> None:
    key_id, token = s.key(budget=10_000)
    out, res_id = s.reserve(key_id, token, prompt=5, asked=4)
    assert out[0] == "ok"
    again, _ = s.reserve(key_id, token, prompt=5, asked=4, res_id=res_id)  # a retried reserve
    assert again[:3] == out[:3] and s.fields(key_id)["reserved"] == out[2]
    assert s.settle(key_id, res_id, 5, 4)[0] == "ok"
    assert s.settle(key_id, res_id, 5, 4) == ["duplicate"]
    f = s.fields(key_id)
    assert f["spent"] == "50" and f["reserved"] == "0" and f["requests"] == "1"
    assert sum(int(r["cost_micro_usd"]) for r in s.records(key_id)) == 50


def test_reaper_returns_dead_replicas_reservations_only(s: Scripts) -> None:
    key_id, token = s.key(budget=10_000)
    dead_out, dead_res = s.reserve(key_id, token, prompt=10, asked=10, replica="dead")
    live_out, live_res = s.reserve(key_id, token, prompt=10, asked=10, replica="alive")
    assert s.fields(key_id)["reserved"] == str(int(dead_out[2]) + int(live_out[2]))
    assert s.reap(key_id, ["alive"]) == 1
    assert s.reap(key_id, ["alive"]) == 0
    assert s.fields(key_id)["reserved"] == live_out[2]
    assert s.records(key_id)[-1]["status"] == "reaped"
    # the "dead" replica was only slow: its late settle still charges the real cost, once
    assert s.settle(key_id, dead_res, 10, 2)[0] == "ok"
    assert s.settle(key_id, dead_res, 10, 2) == ["duplicate"]
    s.settle(key_id, live_res, 10, 1)
    f = s.fields(key_id)
    assert f["reserved"] == "0" and int(f["spent"]) == 40 + 30
    recs = s.records(key_id)
    assert [r["late"] for r in recs if r["status"] == "200"] == ["1", "0"]
    assert sum(int(r["cost_micro_usd"]) for r in recs) == int(f["spent"])


def test_rpm_admits_a_burst_of_exactly_the_limit(s: Scripts) -> None:
    key_id, token = s.key(rpm=5)
    outs = [s.reserve(key_id, token)[0] for _ in range(8)]
    assert [o[0] for o in outs] == ["ok"] * 5 + ["deny"] * 3
    assert outs[5][1] == "rpm_exceeded" and 0 < int(outs[5][2]) <= 12_000


def test_tpm_caps_to_the_bucket_and_refunds_only_what_is_still_in_it(s: Scripts) -> None:
    key_id, token = s.key(tpm=60_000)  # 1 ms per token
    assert s.reserve(key_id, token, prompt=60_001)[0][:2] == ["deny", "tpm_too_small"]
    out, res_a = s.reserve(key_id, token, prompt=59_950, asked=500)
    assert out[:2] == ["ok", "50"]  # max_tokens lowered to what the bucket holds
    s.settle(key_id, res_a, 0, 0)
    out, res_a = s.reserve(key_id, token, prompt=1900, asked=0)
    assert out[1] == "100"  # the default bound
    time.sleep(2.2)  # A's 2,000 tokens have drained
    out_b, _ = s.reserve(key_id, token, prompt=4999, asked=1)
    assert out_b[0] == "ok"
    s.settle(key_id, res_a, 0, 0)  # A used nothing, but nothing of it is left to give back
    # B's 5,000 tokens are still in the bucket (less what drained in the last few ms): 56,000 more
    # do not fit. Giving A's 2,000 back anyway would have made room for them.
    out_c, _ = s.reserve(key_id, token, prompt=55_999, asked=1)
    assert out_c[:2] == ["deny", "tpm_exceeded"]


def test_tpm_refund_makes_room_again(s: Scripts) -> None:
    key_id, token = s.key(tpm=1000)
    out, res_id = s.reserve(key_id, token, prompt=900, asked=100)
    assert out[0] == "ok"
    assert s.reserve(key_id, token, prompt=500, asked=1)[0][:2] == ["deny", "tpm_exceeded"]
    s.settle(key_id, res_id, 100, 10)  # used 110 of its 1,000
    assert s.reserve(key_id, token, prompt=500, asked=1)[0][0] == "ok"


def test_listing_and_admission_judge_a_key_by_one_check_on_redis_clock(s: Scripts) -> None:
    """key_models.lua (/v1/models) and reserve.lua run the same check_key on Redis TIME: run back to
    back in one transaction, they agree on every key state, expiry instants included."""
    now = s.redis_now_ms()
    cases = {"valid": s.key(), "expires_later": s.key(expires_ms=now + 60_000),
             "expired_now": s.key(expires_ms=now), "expired_before": s.key(expires_ms=now - 1)}
    revoked = s.key()
    s.r.hset(redis_keys(revoked[0])[0], "revoked_ms", 1)
    cases["revoked"] = revoked
    for name, (key_id, token) in {**cases, "wrong_secret": (cases["valid"][0], cases["valid"][1] + "x")}.items():
        with s.r.pipeline(transaction=True) as pipe:
            s.key_models_s(keys=redis_keys(key_id)[:1], args=[digest(token)], client=pipe)
            s.reserve_s(keys=redis_keys(key_id)[:2], args=s.reserve_args(token).argv(), client=pipe)
            listed, reserved = pipe.execute()
        assert listed[0] == reserved[0], (name, listed, reserved)
        if listed[0] == "deny":
            assert listed[1] == reserved[1], (name, listed, reserved)
        expected = {"valid": "ok", "expires_later": "ok", "wrong_secret": "invalid_api_key",
                    "revoked": "key_revoked"}.get(name, "key_expired")
        assert (listed[0] if expected == "ok" else listed[1]) == expected, (name, listed)
    assert s.key_models(*cases["valid"]) == ["ok", ",m,"]
