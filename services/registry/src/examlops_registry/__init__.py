"""Registry service: the system of record for endpoints and audit events."""

import examlops.grpcenv  # noqa: F401  (first: gRPC core reads its settings when grpc is imported)

from ._app import build_server, main
from ._settings import RegistrySettings
from ._store import RegistryStore

__all__ = ["RegistrySettings", "RegistryStore", "build_server", "main"]
