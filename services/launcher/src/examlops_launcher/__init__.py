"""Launcher service: substrate adapters behind one interface (plan, start, status, stop)."""

import examlops.grpcenv  # noqa: F401  (first: gRPC core reads its settings when grpc is imported)
