"""Typed engine errors; the servicer maps each onto a gRPC status with a reason."""

from __future__ import annotations

import grpc


class EngineError(Exception):
    """An error the caller sees; `reason` is machine readable."""

    code = grpc.StatusCode.INTERNAL
    reason = "engine_error"

    def __init__(self, message: str, param: str = "") -> None:
        super().__init__(message)
        self.param = param


class AllBackendsFailed(EngineError):
    """Every backend of the endpoint failed or was unreachable; never answered by a stand-in."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "AllBackendsFailed"

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"all backends failed for endpoint:{endpoint}: {detail}")


class ReplicaFailed(AllBackendsFailed):
    """One server of a pool failed an attempt. `kind` says how: `connect` (refused, unreachable,
    connect timeout), `timeout` (no answer in time), `status` (an HTTP error other than a refusal),
    `read` (the connection broke while reading), `protocol` (an answer that is not the API's),
    `engine` (an error event inside a stream). The failover loop decides what happens next."""

    def __init__(self, endpoint: str, base_url: str, kind: str, detail: str, status: int = 0) -> None:
        super().__init__(endpoint, f"{detail} ({base_url})")
        self.base_url, self.kind, self.detail, self.status = base_url, kind, detail, status

    @property
    def retryable(self) -> bool:
        """Worth another replica when nothing has reached the caller yet: the server, not the
        request, is at fault."""
        if self.kind == "status":
            return self.status >= 500
        return self.kind != "engine"


class PoolFailed(AllBackendsFailed):
    """Every replica tried failed (or the deadline ran out): the message names each one's error."""

    def __init__(self, message: str) -> None:
        EngineError.__init__(self, message)


class EngineRejected(EngineError):
    """The engine refused the request itself (4xx): the client's request must change."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "engine_rejected"


class TaskMismatch(EngineError):
    """A call of the wrong kind for the route: embeddings to a generate route, or chat/completions
    to an embed route (the route's engine block `task` decides)."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "model_task_mismatch"


class RouteNotFound(EngineError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "model_not_found"


class MediaRejected(EngineError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, reason: str, message: str, param: str) -> None:
        super().__init__(message, param)
        self.reason = reason
