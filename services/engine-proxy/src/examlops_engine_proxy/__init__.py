"""Engine-proxy service: the InferenceEngine layer behind the gateway and the CLI."""

from ._app import run
from ._settings import EngineProxySettings

__all__ = ["EngineProxySettings", "run"]
