"""Judge calibrations: a judge route's agreement with a labelled set, one record per route.

  {exa:reg}:judge_calibrations  HASH  route -> JudgeCalibration (protobuf JSON)

A record and its audit event (judge.calibrate, target judge:<route>) are written in one MULTI/EXEC.
"""

from __future__ import annotations

import re
from typing import Any

import grpc
import redis.asyncio as redis

from examlops.registry.v1 import registry_pb2 as pb
from examlops.svc import abort, current_caller

from ._checks import refuse_first
from ._prices import _audit
from ._store import AUDIT, from_json, now_ms, to_json

CALIBRATIONS = "{exa:reg}:judge_calibrations"
ROUTE_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


class JudgeStore:
    def __init__(self, client: redis.Redis) -> None:
        self.r: Any = client  # redis-py types replies as sync|async unions; checked by the tests instead

    async def record(self, cal: pb.JudgeCalibration, actor: str) -> pb.JudgeCalibration:
        out = pb.JudgeCalibration()
        out.CopyFrom(cal)
        out.time_ms, out.actor = now_ms(), current_caller().name
        before = await self.r.hget(CALIBRATIONS, cal.route)
        after = to_json(out)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(CALIBRATIONS, cal.route, after)
            pipe.xadd(AUDIT, _audit(actor, "judge.calibrate", f"judge:{cal.route}", before or "", after, out.time_ms))
            await pipe.execute()
        return out

    async def get(self, route: str) -> pb.JudgeCalibration | None:
        raw = await self.r.hget(CALIBRATIONS, route)
        return from_json(raw, pb.JudgeCalibration) if raw is not None else None


class JudgesServicerMixin:
    """RecordJudgeCalibration and GetJudgeCalibration of the Registry service."""

    judges: JudgeStore

    async def RecordJudgeCalibration(self, request: pb.RecordJudgeCalibrationRequest,
                                     context: grpc.aio.ServicerContext) -> pb.JudgeCalibration:
        c = request.calibration
        await refuse_first(context, "invalid_calibration", [
            ("route", not ROUTE_RE.match(c.route), f"invalid judge route {c.route!r}: an endpoint name"),
            ("agreement", not 0 <= c.agreement <= 1, "agreement is a share: between 0 and 1"),
            ("threshold", not 0 <= c.threshold <= 1, "threshold is a share: between 0 and 1"),
            ("samples", c.samples <= 0, "a calibration needs at least one labelled sample"),
            ("set_sha256", not c.set_sha256, "a calibration names the labelled set's SHA-256"),
            ("passed", c.passed != (c.agreement >= c.threshold),
             f"passed must be agreement >= threshold ({c.agreement:g} vs {c.threshold:g})"),
        ])
        return await self.judges.record(c, request.actor)

    async def GetJudgeCalibration(self, request: pb.GetJudgeCalibrationRequest,
                                  context: grpc.aio.ServicerContext) -> pb.JudgeCalibration:
        found = await self.judges.get(request.route)
        if found is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, "calibration_not_found",
                        f"judge route {request.route!r} has no calibration: run `exa serve challenger calibrate "
                        f"--judge-model {request.route} --set FILE`", "route")
        return found
