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
