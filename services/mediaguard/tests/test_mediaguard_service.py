"""The gRPC servicer around the validator: typed rejections with reason and part, counted by rule and endpoint."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from examlops.mediaguard.v1 import mediaguard_pb2 as pb
from examlops.svc import PARAM_KEY, REASON_KEY
from examlops_mediaguard._service import MediaGuardServicer
from examlops_testsupport.media_corpus import POLICY_KWARGS, request


class _Aborted(Exception):
    pass


class _Context:
    """Just enough of grpc.aio.ServicerContext to see what the servicer ends a call with."""

    def __init__(self) -> None:
        self.trailing: dict[str, str] = {}
        self.code: grpc.StatusCode | None = None

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailing = dict(md)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)


def _validate(messages: list[Any], policy: dict[str, Any], endpoint: str) -> tuple[Any, _Context]:
    ctx = _Context()
    req = pb.ValidateRequest(messages_json=json.dumps(messages).encode(), policy_json=json.dumps(policy),
                             endpoint=endpoint)
    try:
        return asyncio.run(MediaGuardServicer().Validate(req, ctx)), ctx  # type: ignore[arg-type]
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
