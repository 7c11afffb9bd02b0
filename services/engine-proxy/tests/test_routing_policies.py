"""Routing policies on plain replica states: keys, least-load, bounded-load hashing, sessions, rotation."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb
from examlops_engine_proxy._routing import (
    PREFIX_CHARS,
    STALE_AFTER_S,
    Router,
    UnknownRouting,
    affinity_key,
)
from examlops_testsupport.routing import CandidateState

NOW = 1_000.0
CHAT, COMPLETION = pb.REQUEST_KIND_CHAT, pb.REQUEST_KIND_COMPLETION
LONG_SYSTEM = "You are the support agent of ACME. " + " ".join(f"Rule {i}: be precise." for i in range(400))


@dataclass
class Replica(CandidateState):
    metrics_at: float = NOW     # fresh


def pool(n: int, **fields: float) -> list[Replica]:
    return [Replica(f"r{i}", **fields) for i in range(n)]  # type: ignore[arg-type]


def chat(system_prompt: str, question: str, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}],
            **extra}


# --- keys -----------------------------------------------------------------------------------------

def test_prefix_key_is_the_shared_long_system_prompt_and_spreads_short_ones() -> None:
    assert len(LONG_SYSTEM) > 2 * PREFIX_CHARS
    same = {affinity_key("prefix", CHAT, chat(LONG_SYSTEM, f"question {i}"), "") for i in range(20)}
    assert len(same) == 1
    other = affinity_key("prefix", CHAT, chat(LONG_SYSTEM.replace("ACME", "Initech"), "question 1"), "")
    assert other not in same
    short = {affinity_key("prefix", CHAT, chat("You are a helpful assistant.", f"question {i}"), "")
             for i in range(20)}
    assert len(short) == 20


def test_prefix_key_reads_roles_text_parts_and_completion_prompts() -> None:
    as_parts = chat("", "")
    as_parts["messages"] = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                         {"type": "text", "text": "What is it?"}]}]
    key = affinity_key("prefix", CHAT, as_parts, "")
    assert key is not None and len(key) == 16
    with_roles_swapped = chat("", "")
    with_roles_swapped["messages"] = [{"role": "user", "content": "Be brief."}]
    assert affinity_key("prefix", CHAT, with_roles_swapped, "") != affinity_key(
        "prefix", CHAT, {"messages": [{"role": "system", "content": "Be brief."}]}, "")
    prompt = LONG_SYSTEM + " Complete this: "
    assert affinity_key("prefix", COMPLETION, {"prompt": prompt + "a"}, "") == affinity_key(
        "prefix", COMPLETION, {"prompt": [prompt + "b", "x"]}, "")
    assert affinity_key("prefix", COMPLETION, {"prompt": [*range(300), 1]}, "") == affinity_key(
        "prefix", COMPLETION, {"prompt": [*range(300), 2]}, "")
    assert affinity_key("prefix", CHAT, {"messages": []}, "") is None
    assert affinity_key("prefix", COMPLETION, {}, "") is None


def test_session_key_is_the_header_else_the_user_field() -> None:
    assert affinity_key("session", CHAT, chat("s", "u", user="alice"), "sess-1") == "sess-1"
    assert affinity_key("session", CHAT, chat("s", "u", user="alice"), "") == "alice"
    assert affinity_key("session", CHAT, chat("s", "u", user=""), "") is None
    assert affinity_key("session", CHAT, chat("s", "u", user=42), "") is None
    for policy in ("least-load", "round-robin"):
        assert affinity_key(policy, CHAT, chat("s", "u", user="alice"), "sess-1") is None


# --- every policy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["least-load", "prefix", "session", "round-robin"])
def test_one_candidate_is_taken_at_once(policy: str) -> None:
    only = Replica("r7", in_flight=99, metrics_at=0.0)
    assert Router(policy, ["r0", "r7"]).pick([only], "key", NOW) == (only, "only")


def test_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(UnknownRouting, match="least-load, prefix, session, round-robin"):
        Router("random", ["r0"])


# --- least-load -----------------------------------------------------------------------------------

def test_least_load_takes_the_lightest_counting_queue_in_flight_and_kv_pressure() -> None:
    router = Router("least-load", ["r0", "r1", "r2"])
    reps = [Replica("r0", running=4), Replica("r1", waiting=1, in_flight=1), Replica("r2", running=3)]
    assert router.pick(reps, None, NOW) == (reps[1], "least-load")
    reps = [Replica("r0", running=2, kv_cache_usage=0.97), Replica("r1", running=3, kv_cache_usage=0.2)]
    assert router.pick(reps, None, NOW)[0] is reps[1]


def test_least_load_ties_rotate_so_equal_replicas_share() -> None:
    router = Router("least-load", ["r0", "r1", "r2"])
    reps = pool(3, running=2)
    picks = Counter(router.pick(reps, None, NOW)[0].id for _ in range(300))
    assert picks == {"r0": 100, "r1": 100, "r2": 100}


def test_stale_metrics_count_as_saturated_until_every_replica_is_stale() -> None:
    router = Router("least-load", ["r0", "r1"])
    stale = Replica("r0", metrics_at=NOW - STALE_AFTER_S - 0.1)
    busy = Replica("r1", running=30, waiting=10)
    assert all(router.pick([stale, busy], None, NOW)[0] is busy for _ in range(10))
    never = [Replica("r0", in_flight=3, metrics_at=0.0), Replica("r1", in_flight=1, metrics_at=0.0)]
    assert router.pick(never, None, NOW)[0] is never[1]


def test_least_load_keeps_a_closed_loop_balanced() -> None:
    """Each pick adds an in-flight request: the in-flight counts never drift more than one apart."""
    router = Router("least-load", ["r0", "r1", "r2"])
    reps = pool(3, metrics_at=0.0)
    for _ in range(100):
        router.pick(reps, None, NOW)[0].in_flight += 1
        counts = [r.in_flight for r in reps]
        assert max(counts) - min(counts) <= 1


# --- prefix / session (bounded-load consistent hashing) -------------------------------------------

def test_keys_stick_to_one_replica_and_spread_over_the_pool() -> None:
    router = Router("prefix", [f"r{i}" for i in range(4)])
    reps = pool(4)
    owners = Counter()
    for i in range(4000):
        key = f"key-{i}"
        first = router.pick(reps, key, NOW)
        assert first[1] == "prefix"
        assert all(router.pick(reps, key, NOW) == first for _ in range(3))
        owners[first[0].id] += 1
    assert all(700 <= owners[r.id] <= 1300 for r in reps), owners


def test_bounded_load_moves_a_hot_key_off_its_overloaded_owner() -> None:
    router = Router("prefix", ["r0", "r1"])
    reps = pool(2)
    owner, reason = router.pick(reps, "hot", NOW)
    other = reps[1] if owner is reps[0] else reps[0]
    assert reason == "prefix"
    owner.running = 6                          # bound: ceil(1.25 * 7 / 2) = 5
    assert router.pick(reps, "hot", NOW) == (other, "prefix-overflow")
    owner.running, other.running = 4, 2        # bound: ceil(1.25 * 7 / 2) = 5 > 4
    assert router.pick(reps, "hot", NOW) == (owner, "prefix")


def test_a_hot_key_under_load_stays_within_the_bound() -> None:
    """One key, 100 requests that never finish: its owner takes ~c × the mean, the rest overflow."""
    router = Router("session", [f"r{i}" for i in range(4)])
    reps = pool(4, metrics_at=0.0)
    reasons = Counter()
    for placed in range(100):
        chosen, reason = router.pick(reps, "user-42", NOW)
        chosen.in_flight += 1
        reasons[reason] += 1
        assert max(r.in_flight for r in reps) <= math.ceil(1.25 * (placed + 1) / 4)
    assert max(r.in_flight for r in reps) <= 32
    assert reasons["session"] >= 30 and reasons["session-overflow"] >= 50, reasons


def test_removing_a_replica_moves_only_its_keys() -> None:
    ids = [f"r{i}" for i in range(5)]
    before = Router("prefix", ids)
    after = Router("prefix", ids[:2] + ids[3:])
    reps = {r.id: r for r in pool(5)}
    keys = [f"prompt-{i}" for i in range(2000)]
    owner_before = {k: before.pick(list(reps.values()), k, NOW)[0].id for k in keys}
    survivors = [reps[i] for i in ids if i != "r2"]
    moved = 0
    for k in keys:
        now_owner = after.pick(survivors, k, NOW)[0].id
        # the old ring with r2 merely absent from the candidates must agree with the rebuilt ring
        assert before.pick(survivors, k, NOW)[0].id == now_owner
        if owner_before[k] == "r2":
            moved += 1
        else:
            assert now_owner == owner_before[k], k
    assert 250 <= moved <= 550


def test_stale_replicas_lose_their_keys_until_every_replica_is_stale() -> None:
    router = Router("prefix", ["r0", "r1"])
    reps = pool(2)
    key = next(f"k{i}" for i in range(100) if router.pick(reps, f"k{i}", NOW)[0] is reps[0])
    reps[0].metrics_at = NOW - 10
    assert router.pick(reps, key, NOW) == (reps[1], "prefix")
    reps[1].metrics_at = 0.0
    assert router.pick(reps, key, NOW) == (reps[0], "prefix")


def test_no_key_or_a_ring_without_the_candidates_falls_back_to_least_load() -> None:
    router = Router("prefix", ["r0", "r1"])
    reps = [Replica("r0", running=5), Replica("r1")]
    assert router.pick(reps, None, NOW) == (reps[1], "least-load")
    strangers = [Replica("x0", running=5), Replica("x1")]
    assert router.pick(strangers, "key", NOW) == (strangers[1], "least-load")


def test_session_sticks_and_sessions_spread() -> None:
    router = Router("session", ["r0", "r1", "r2"])
    reps = pool(3)
    owners = {s: router.pick(reps, s, NOW) for s in (f"user-{i}" for i in range(300))}
    assert all(reason == "session" for _, reason in owners.values())
    assert all(router.pick(reps, s, NOW) == owners[s] for s in owners)
    assert len({rep.id for rep, _ in owners.values()}) == 3


# --- round-robin ----------------------------------------------------------------------------------

def test_round_robin_is_fair_whatever_the_load() -> None:
    router = Router("round-robin", ["r0", "r1", "r2"])
    reps = [Replica("r0", running=50), Replica("r1"), Replica("r2", metrics_at=0.0)]
    picks = Counter()
    for _ in range(300):
        rep, reason = router.pick(reps, "ignored", NOW)
        assert reason == "round-robin"
        picks[rep.id] += 1
    assert picks == {"r0": 100, "r1": 100, "r2": 100}


# --- cost (printed, not asserted) -----------------------------------------------------------------

def test_pick_cost_is_printed() -> None:
    body = chat(LONG_SYSTEM, "What is the refund policy?")
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        affinity_key("prefix", CHAT, body, "")
    key_us = (time.perf_counter() - t0) / n * 1e6
    line = [f"affinity_key(prefix) {key_us:.2f} µs"]
    for policy in ("least-load", "prefix", "session", "round-robin"):
        for size in (2, 8):
            router = Router(policy, [f"r{i}" for i in range(size)])
            reps = pool(size, running=1)
            t0 = time.perf_counter()
            for i in range(n):
                router.pick(reps, "0123456789abcdef" if i & 1 else "fedcba9876543210", NOW)
            line.append(f"{policy}/{size} {(time.perf_counter() - t0) / n * 1e6:.2f} µs")
    print("\npick cost: " + ", ".join(line))
