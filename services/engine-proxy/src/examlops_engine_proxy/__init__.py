"""Engine-proxy service: the InferenceEngine layer behind the gateway and the CLI."""

import examlops.grpcenv  # noqa: F401  (first: gRPC core reads its settings when grpc is imported)

from ._app import run
from ._settings import EngineProxySettings

__all__ = ["EngineProxySettings", "run"]
