"""A price change reaches the gateway at once (the registry's WatchPrices), not at the next resync.

The stack resyncs prices only every 60 s, so a call that succeeds within two seconds of
`exa gateway price set` was admitted on the price the watch delivered.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import openai
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops_testsupport.fixtures import RedisServer, Stack, running_stack, wait_until

SLOW_RESYNC = {"EXAMLOPS_PRICE_REFRESH_S": "60"}


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("prices"), redis_server, SLOW_RESYNC) as stack:
        stack.register("priced-live", engine="echo")
        yield stack


def _call(key: str, stack: Stack) -> str:
    """'ok', or the error code the gateway answered."""
    c = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)
    try:
        c.chat.completions.create(model="priced-live", messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError as exc:
        assert isinstance(exc.body, dict)
        return str(exc.body["code"])
    finally:
        c.close()
    return "ok"


def _first_ok_within(key: str, stack: Stack, want: str, seconds: float) -> float:
    start = time.monotonic()
    while (got := _call(key, stack)) != want:
        assert time.monotonic() - start < seconds, f"still {got!r} after {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_price_set_and_removal_reach_the_gateway_within_a_second(slow: Stack) -> None:
    issued = slow.cli("--json", "gateway", "key", "issue", "--tenant", "t", "--project", "p",
                      "--model", "priced-live", "--budget", "1")
    assert issued.returncode == 0, issued.stderr
    key = json.loads(issued.stdout)["virtual_key"]
    wait_until(lambda: _call(key, slow) == "model_not_priced", 10)  # routed, not yet priced

    out = slow.cli("gateway", "price", "set", "priced-live", "--input-per-mtok", "1", "--output-per-mtok", "2")
    assert out.returncode == 0, out.stderr
    took = _first_ok_within(key, slow, "ok", 2.0)
    print(f"\nprice set -> first admitted call: {took * 1000:.0f} ms (resync every 60 s)")

    slow.registry().RemovePrice(reg.RemovePriceRequest(model="priced-live", actor="tests"), timeout=5)
    _first_ok_within(key, slow, "model_not_priced", 2.0)
