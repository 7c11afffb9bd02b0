"""The engine-proxy side of media safety: detect media, ask mediaguard, map its verdict."""

from __future__ import annotations

import json
from typing import Any

import grpc
import orjson

from examlops.mediaguard.v1 import mediaguard_pb2 as mg
from examlops.mediaguard.v1 import mediaguard_pb2_grpc as mg_grpc
from examlops.mediaparts import has_media
from examlops.svc import error_reason

from ._errors import AllBackendsFailed, MediaRejected

__all__ = ["guard_messages", "has_media", "policy_json"]


def policy_json(engine_block_json: str) -> str:
    """The endpoint's multimodal policy as JSON (text-only when the block has none)."""
    block = json.loads(engine_block_json) if engine_block_json else {}
    return json.dumps(block.get("multimodal") or {"modality": "text"})


async def guard_messages(stub: mg_grpc.MediaGuardStub, endpoint: str, messages: list[Any],
                         engine_block_json: str, timeout_s: float = 2.0) -> tuple[list[Any], int]:
    """Validated messages (URLs normalised) and the count of media parts dropped for text engines."""
    try:
        resp = await stub.Validate(mg.ValidateRequest(
            messages_json=orjson.dumps(messages), policy_json=policy_json(engine_block_json),
            endpoint=endpoint), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            reason, param = error_reason(exc)
            raise MediaRejected(reason or "media_invalid", exc.details() or "media rejected", param) from None
        # Fail closed: media is never forwarded unchecked.
        raise AllBackendsFailed(endpoint, f"media guard unavailable ({exc.code().name}); "
                                          "media requests are refused until it answers") from None
    return orjson.loads(resp.messages_json), resp.media_parts_dropped
