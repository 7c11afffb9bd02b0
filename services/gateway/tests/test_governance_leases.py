"""Reservations on a real Redis: the lease of a live replica's reservation, and the real cost of a
reaped call charged exactly once (reap.lua charges the gateway's last progress note, a late settle
the rest). The scripts are called as the gateway calls them, with their named arguments.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from examlops_gateway.governance import ReserveArgs, SettleArgs, digest, load_script, new_key, redis_keys
from examlops_gateway.governance._scripts import ProgressArgs
from examlops_testsupport.fixtures import RedisServer, wait_until

PRICE = 1_000_000  # micro-USD per Mtok: 1 micro-USD a token, in and out


class Leases:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        names = ("reserve", "settle", "reap", "progress")
        self.scripts: dict[str, Any] = {n: load_script(r, f"{n}.lua") for n in names}
        # Not in KEY_INDEX: a gateway of another test sharing this Redis would reap these reservations
        # (their replicas are not its live ones) while a test waits on a lease.
        self.key_id, token = new_key()
        self.r.hset(redis_keys(self.key_id)[0], mapping={
            "id": self.key_id, "hash": digest(token), "tenant": "t", "project": "p", "models": ",m,", "budget": 10_000,
            "rpm": 0, "tpm": 0, "expires_ms": 0, "revoked_ms": 0, "created_ms": 1, "spent": 0, "reserved": 0,
            "requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "reaped": 0, "rpm_tat": 0, "tpm_tat": 0})
        self.hash = digest(token)

    def reserve(self, replica: str, lease_ms: int) -> str:
        res_id = secrets.token_hex(8)
        out = self.scripts["reserve"](keys=redis_keys(self.key_id)[:2], args=ReserveArgs(
            key_hash=self.hash, model="m", res_id=res_id, replica_id=replica, prompt_tokens=10, prompt_cost=10 * PRICE,
            output_rate=PRICE, n=1, max_tokens_asked=100, default_max_tokens=100, priced=True,
            lease_ms=lease_ms).argv())
        assert out[0] == "ok"
        return res_id

    def reap(self, *live: str) -> int:
        return int(self.scripts["reap"](keys=redis_keys(self.key_id), args=[self.key_id, 600_000, 0, *live]))

    def note(self, res_id: str, prompt: int, completion: int) -> int:
        return int(self.scripts["progress"](keys=redis_keys(self.key_id)[1:2], args=ProgressArgs(
            res_id, prompt + completion, prompt, completion).argv()))

    def settle(self, res_id: str, prompt: int, completion: int) -> list[str]:
        out: list[str] = self.scripts["settle"](keys=redis_keys(self.key_id), args=SettleArgs(
            res_id=res_id, cost_micro=prompt + completion, prompt_tokens=prompt, completion_tokens=completion,
            key_id=self.key_id, model="m", status="200", latency_ms=1, ttft_ms=1, stream=True, estimated=False,
            priced=True, trim_ms=0).argv())
        return out

    def open(self) -> list[str]:
        return [f for f in self.r.hkeys(redis_keys(self.key_id)[1]) if ":" not in f]  # type: ignore[union-attr]

    def fields(self) -> dict[str, str]:
        return self.r.hgetall(redis_keys(self.key_id)[0])  # type: ignore[return-value]

    def records(self) -> list[dict[str, str]]:
        return [f for _id, f in self.r.xrange(redis_keys(self.key_id)[2])]  # type: ignore[union-attr]

    def redis_ms(self) -> int:
        secs, micros = self.r.time()  # type: ignore[misc]
        return int(secs) * 1000 + int(micros) // 1000


@pytest.fixture
def leases(redis_server: RedisServer) -> Iterator[Leases]:
    r = redis_server.client()
    yield Leases(r)
    r.close()


def test_a_live_replicas_reservation_is_kept_for_its_lease_and_returned_after(leases: Leases) -> None:
    """REQUEST_TIMEOUT_S + RESERVATION_GRACE_S is the lease: before it ends a live replica's call is
    still running and keeps its reservation; after, the reservation is returned."""
    res_id = leases.reserve("alive", lease_ms=1500)
    start = leases.redis_ms()  # after the reserve: its lease runs from the reserve's own clock reading
    reserved = leases.fields()["reserved"]
    assert int(reserved) > 0
    assert leases.reap("alive") == 0 and leases.open() == [res_id]  # live and within its lease: kept
    assert leases.fields()["reserved"] == reserved
    wait_until(lambda: leases.redis_ms() > start + 1500 + 5, 10, 0.05)
    assert leases.reap("alive") == 1 and leases.open() == []  # live, but its lease ran out: returned
    f = leases.fields()
    assert f["reserved"] == "0" and f["reaped"] == "1"
    assert [r["status"] for r in leases.records()] == ["reaped"]


def test_a_reaped_call_is_charged_its_progress_note_then_the_rest_once(leases: Leases) -> None:
    res_id = leases.reserve("gone", lease_ms=600_000)
    assert leases.note(res_id, 10, 30) == 1
    assert leases.reap() == 1  # its replica is dead: returned, charging what it had noted as delivered
    f = leases.fields()
    assert (f["spent"], f["reserved"], f["completion_tokens"]) == ("40", "0", "30")
    assert leases.records()[-1]["cost_micro_usd"] == "40" and leases.records()[-1]["status"] == "reaped"
    # the gateway was only slow: its settle charges the rest of the real cost (10 + 50), once
    assert leases.settle(res_id, 10, 50)[0] == "ok"
    assert leases.settle(res_id, 10, 50) == ["duplicate"]
    late = leases.records()[-1]
    assert (late["cost_micro_usd"], late["completion_tokens"], late["late"]) == ("20", "20", "1")
    f = leases.fields()
    assert f["spent"] == "60" == str(sum(int(r["cost_micro_usd"]) for r in leases.records()))
    assert f["completion_tokens"] == "50"


def test_a_progress_note_after_the_settle_changes_nothing(leases: Leases) -> None:
    res_id = leases.reserve("alive", lease_ms=600_000)
    assert leases.settle(res_id, 10, 5)[0] == "ok"
    assert leases.note(res_id, 10, 90) == 0
    assert leases.r.hkeys(redis_keys(leases.key_id)[1]) == []
    assert leases.reap() == 0 and leases.fields()["spent"] == "15"
