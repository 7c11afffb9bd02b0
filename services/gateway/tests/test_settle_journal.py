"""The settle journal (governance/_durability.py): what a replica re-sends after the store restarted.

Its `settle` is the one call it makes; here it stands for settle.lua and records what was re-sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

from examlops_gateway.governance._durability import SettleJournal


def settle_args(n: int) -> tuple[list[str], list[Any]]:
    return [f"{{vk:k{n}}}:key"], [f"res{n}", n]


def test_a_replay_resends_the_settles_kept_before_it_began_not_those_that_keep_coming() -> None:
    journal = SettleJournal()
    for n in range(3):
        journal.add(*settle_args(n))
    sent: list[str] = []

    async def settle(keys: list[str], argv: list[Any]) -> list[str]:
        sent.append(argv[0])
        if len(sent) < 1000:  # calls keep settling on the new run, one each round trip of the replay
            journal.add(*settle_args(100 + len(sent)))
        return ["duplicate"]

    assert asyncio.run(journal.replay(settle)) == (0, 3)
    assert sent == ["res0", "res1", "res2"]
    assert len(journal.entries) == 3  # acknowledged by the new run: kept for its own window


def test_the_journal_never_holds_more_than_its_bound() -> None:
    journal = SettleJournal(max_entries=5)  # a store that cannot be watched confirms nothing
    for n in range(12):
        journal.add(*settle_args(n))
    assert [argv[0] for _, _, argv in journal.entries] == [f"res{n}" for n in range(7, 12)]
    assert journal.dropped == 7


def test_a_replay_that_meets_a_redis_error_keeps_what_did_not_land_in_order() -> None:
    journal = SettleJournal()
    for n in range(200):  # more than one batch of REPLAY_CONCURRENCY
        journal.add(*settle_args(n))
    landed: list[str] = []

    async def settle(keys: list[str], argv: list[Any]) -> list[str]:
        await asyncio.sleep(0)
        if argv[0] in ("res70", "res75"):  # the second batch: two of its settles meet a dead store
            raise ConnectionError("store gone")
        landed.append(argv[0])
        return ["ok"]

    try:
        asyncio.run(journal.replay(settle))
        raise AssertionError("the Redis error must reach the caller, to replay again later")
    except ConnectionError:
        pass
    left = [argv[0] for _, _, argv in journal.entries]
    assert left == ["res70", "res75"] + [f"res{n}" for n in range(128, 200)]
    assert sorted(landed + left, key=lambda r: int(r[3:])) == [f"res{n}" for n in range(200)]

    landed.clear()
    assert asyncio.run(journal.replay(lambda keys, argv: _ok(argv, landed))) == (74, 0)
    assert not journal.entries and len(landed) == 74


async def _ok(argv: list[Any], landed: list[str]) -> list[str]:
    landed.append(argv[0])
    return ["ok"]
