"""Shared by the deployment-file tests (compose, k8s, Dockerfiles): the stack's parts and tools."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from examlops_testsupport import REPO_ROOT

ROOT = REPO_ROOT
BIN = Path(sys.executable).parent
SERVICES = ("registry", "launcher", "mediaguard", "engine-proxy", "gateway")
GRPC_SERVICES = tuple(s for s in SERVICES if s != "gateway")
UID = 10001

# The real dependencies between the parts of the stack (compose `depends_on`).
DEPENDS_ON = {
    "registry": {"redis"},
    "mediaguard": set(),
    "engine-proxy": {"registry", "mediaguard"},
    "launcher": {"registry"},
    "gateway": {"redis", "registry", "engine-proxy"},
}


def module_of(service: str) -> str:
    return "examlops_" + service.replace("-", "_")


def tool(name: str, package: str) -> Path:
    path = BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: `pip install -r requirements-dev.txt` installs it (PyPI {package})")
    return path


def load_script(name: str) -> ModuleType:
    """A module of scripts/ (not a package), e.g. lock_images, for the tests that check what it writes."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
