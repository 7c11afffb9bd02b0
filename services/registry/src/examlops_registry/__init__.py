"""Registry service: the system of record for endpoints and audit events."""

from ._app import build_server, main
from ._settings import RegistrySettings
from ._store import RegistryStore

__all__ = ["RegistrySettings", "RegistryStore", "build_server", "main"]
