"""Container healthcheck: `python -m examlops.svc.healthcheck HOST:PORT [SERVICE]` exits 0 when SERVING."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m examlops.svc.healthcheck HOST:PORT [SERVICE]\n")
        return 2
    service = argv[1] if len(argv) > 1 else ""
    with grpc.insecure_channel(argv[0]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3
            )
        except grpc.RpcError as exc:
            sys.stderr.write(f"{argv[0]}: {exc.code().name}\n")
            return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
