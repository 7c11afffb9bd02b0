"""The gRPC servicer around the validator: typed rejections with reason and part, counted by rule and endpoint;
an allowed media host that resolves to a private address is refused unless the policy allows it.

That host is a real name resolved by this machine's real resolver (its own host name or Debian's
ip6-localhost, see examlops_testsupport.dns): no stub resolver stands in.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from examlops.mediaguard.v1 import mediaguard_pb2 as pb
from examlops.svc import PARAM_KEY, REASON_KEY
from examlops_mediaguard._addresses import AddressCheck, non_global
from examlops_mediaguard._service import MediaGuardServicer
from examlops_testsupport.dns import private_host_name
from examlops_testsupport.media_corpus import PART_PARAM, POLICY_KWARGS, image, request

HOST, ADDRESSES = private_host_name()


class _Aborted(Exception):
    pass


class _Context:
    """Just enough of grpc.aio.ServicerContext to see what the servicer ends a call with."""

    def __init__(self) -> None:
        self.trailing: dict[str, str] = {}
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailing = dict(md)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted(details)


def _validate(messages: list[Any], policy: dict[str, Any], endpoint: str,
              check: AddressCheck | None = None) -> tuple[Any, _Context]:
    ctx = _Context()
    req = pb.ValidateRequest(messages_json=json.dumps(messages).encode(), policy_json=json.dumps(policy),
                             endpoint=endpoint)
    try:
        return asyncio.run(MediaGuardServicer(check).Validate(req, ctx)), ctx  # type: ignore[arg-type]
    except _Aborted:
        return None, ctx


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_rejection_is_typed_and_counted_by_reason_and_endpoint() -> None:
    part = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}
    before = _count("examlops_mediaguard_rejections_total", reason="media_ip_literal_not_allowed", endpoint="vl-1")
    resp, ctx = _validate(request(part), POLICY_KWARGS, "vl-1")
    assert resp is None and ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.trailing == {REASON_KEY: "media_ip_literal_not_allowed", PARAM_KEY: "messages[0].content[1]"}
    after = _count("examlops_mediaguard_rejections_total", reason="media_ip_literal_not_allowed", endpoint="vl-1")
    assert after == before + 1


def test_accepted_parts_come_back_normalised_and_counted() -> None:
    part = {"type": "image_url", "image_url": {"url": "HTTPS://IMG.EXAMPLE.COM:443/a.png"}}
    before = _count("examlops_mediaguard_parts_validated_total", kind="image", endpoint="vl-2")
    resp, ctx = _validate(request(part), POLICY_KWARGS, "vl-2")
    assert ctx.code is None
    assert json.loads(resp.messages_json)[0]["content"][1]["image_url"]["url"] == "https://img.example.com/a.png"
    assert dict(resp.media_counts) == {"image": 1}
    assert _count("examlops_mediaguard_parts_validated_total", kind="image", endpoint="vl-2") == before + 1


def test_text_only_policy_drops_media_and_says_how_many() -> None:
    part = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    resp, _ = _validate(request(part) * 2, {"modality": "text"}, "txt")
    assert resp.media_parts_dropped == 2
    assert all(p["type"] == "text" for m in json.loads(resp.messages_json) for p in m["content"])


@pytest.mark.parametrize("policy", ['{"modality": "vision"}', "not json"])
def test_a_bad_policy_is_refused_not_ignored(policy: str) -> None:
    ctx = _Context()
    req = pb.ValidateRequest(messages_json=b"[]", policy_json=policy, endpoint="x")
    with pytest.raises(_Aborted):
        asyncio.run(MediaGuardServicer().Validate(req, ctx))  # type: ignore[arg-type]
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT


def _policy(domains: list[str], **extra: Any) -> dict[str, Any]:
    return {"modality": "vision", "limit_mm_per_prompt": {"image": 2}, "allowed_media_domains": domains, **extra}


def test_an_allowed_host_resolving_to_a_private_address_is_refused_naming_the_part() -> None:
    resp, ctx = _validate(request(image(f"http://{HOST}/cat.png")), _policy([HOST]), "vl-private")
    assert resp is None and ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.trailing == {REASON_KEY: "media_private_address", PARAM_KEY: PART_PARAM}
    assert HOST in ctx.details and "private" in ctx.details


def test_the_policy_may_allow_private_addresses() -> None:
    resp, ctx = _validate(request(image(f"http://{HOST}/cat.png")), _policy([HOST], allow_private_addresses=True),
                          "vl-private")
    assert ctx.code is None, ctx.details
    assert json.loads(resp.messages_json)[0]["content"][1]["image_url"]["url"] == f"http://{HOST}/cat.png"


def test_a_name_that_does_not_exist_passes_and_is_cached() -> None:
    # RFC 2606 reserves .invalid: no resolver answers it with an address, and nothing can be fetched.
    check = AddressCheck()
    _, ctx = _validate(request(image("http://nothing.invalid/x.png")), _policy(["invalid"]), "vl-private", check)
    assert ctx.code is None, ctx.details
    assert check._cache["nothing.invalid"][1] == []


def test_a_resolver_that_does_not_answer_in_time_refuses() -> None:
    _, ctx = _validate(request(image(f"http://{HOST}/cat.png")), _policy([HOST]), "vl-private",
                       AddressCheck(timeout_s=0))
    assert ctx.trailing.get(REASON_KEY) == "media_private_address" and "did not answer" in ctx.details


def test_only_global_addresses_are_public() -> None:
    private = ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
               "::1", "fe80::1%eth0", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "224.0.0.1"]
    assert all(non_global(a) for a in private)
    assert not any(non_global(a) for a in ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c", "8.8.8.8"])
    assert all(non_global(a) for a in ADDRESSES)
