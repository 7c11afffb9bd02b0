"""MediaGuard gRPC servicer: the pure validator behind one RPC."""

from __future__ import annotations

import grpc
import orjson
from prometheus_client import Counter
from pydantic import ValidationError

from examlops.engine import MultimodalPolicy
from examlops.mediaguard.v1 import mediaguard_pb2 as pb
from examlops.mediaguard.v1 import mediaguard_pb2_grpc as pb_grpc
from examlops.svc import abort

from ._addresses import AddressCheck
from ._validate import MediaRejected, strip_media, validate_messages

REJECTIONS = Counter("examlops_mediaguard_rejections_total", "Media parts rejected, by rule and endpoint.",
                     ["reason", "endpoint"])
VALIDATED = Counter("examlops_mediaguard_parts_validated_total", "Media parts accepted, by kind.",
                    ["kind", "endpoint"])
DROPPED = Counter("examlops_mediaguard_parts_dropped_total",
                  "Media parts dropped for text-only endpoints.", ["endpoint"])


class MediaGuardServicer(pb_grpc.MediaGuardServicer):
    def __init__(self, addresses: AddressCheck | None = None) -> None:
        self.addresses = addresses or AddressCheck()

    async def Validate(self, request: pb.ValidateRequest, context: grpc.aio.ServicerContext) -> pb.ValidateResponse:
        try:
            messages = orjson.loads(request.messages_json)
            policy = MultimodalPolicy.model_validate_json(request.policy_json or '{"modality": "text"}')
        except (orjson.JSONDecodeError, ValidationError) as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "media_request_malformed",
                        f"cannot read the request or policy: {exc}", "messages")
        if not isinstance(messages, list):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "media_request_malformed",
                        "messages must be a list", "messages")
        if policy.modality == "text":
            stripped, dropped = strip_media(messages)
            if dropped:
                DROPPED.labels(request.endpoint).inc(dropped)
            return pb.ValidateResponse(messages_json=orjson.dumps(stripped), media_parts_dropped=dropped)
        try:
            result = validate_messages(messages, policy)
            if not policy.allow_private_addresses:
                await self.addresses.check(result.messages)
        except MediaRejected as exc:
            REJECTIONS.labels(exc.code, request.endpoint).inc()
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc.code, exc.message, exc.param)
        for kind, n in result.counts.items():
            VALIDATED.labels(kind, request.endpoint).inc(n)
        return pb.ValidateResponse(messages_json=orjson.dumps(result.messages), media_counts=result.counts)
