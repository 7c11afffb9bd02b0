"""The plan of the house, read from the source: imports point down, private modules stay private.

  contracts (examlops.<service>.v1)  <-  library (examlops.engine, .svc, ...)  <-  services, CLI
  developer tooling (examlops_devstack, examlops_testsupport) is imported by tests and tools only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from examlops_testsupport import REPO_ROOT

SERVICES = {p.name: next((p / "src").iterdir()).name for p in (REPO_ROOT / "services").iterdir()
            if (p / "src").is_dir()}
CONTRACT_PACKAGES = {"registry", "launcher", "mediaguard", "engine_proxy"}
DEV_TOOLING = ("examlops_devstack", "examlops_testsupport", "pytest")


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "_pb2" not in p.name)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import in a file, relative imports excluded."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:  # `from examlops.engine import _inproc` reaches a private module too
                yield node.lineno, f"{node.module}.{alias.name}"


def _consumers() -> list[Path]:
    return [*_python_files(REPO_ROOT / "cli" / "src"),
            *(f for p in (REPO_ROOT / "services").iterdir() if (p / "src").is_dir()
              for f in _python_files(p / "src"))]


def test_the_tree_has_the_parts_this_test_reads() -> None:
    assert set(SERVICES) == {"gateway", "registry", "launcher", "mediaguard", "engine-proxy"}
    assert len(_consumers()) > 50


def test_services_and_cli_import_only_public_names_of_the_library() -> None:
    bad = [f"{path.relative_to(REPO_ROOT)}:{line} imports {mod}"
           for path in _consumers() for line, mod in _imports(path)
           if mod.startswith("examlops.") and any(part.startswith("_") for part in mod.split(".")[1:])]
    assert not bad, "import the library's public surface (its __init__ exports) instead:\n" + "\n".join(bad)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_no_service_imports_another_service(service: str) -> None:
    own = SERVICES[service]
    others = {pkg for pkg in SERVICES.values() if pkg != own} | {"examlops_cli"}
    src = REPO_ROOT / "services" / service / "src"
    bad = [f"{path.relative_to(REPO_ROOT)}:{line} imports {mod}" for path in _python_files(src)
           for line, mod in _imports(path) if mod.split(".")[0] in others]
    assert not bad, "services talk over gRPC, never through each other's code:\n" + "\n".join(bad)


def test_shipped_code_never_imports_developer_tooling() -> None:
    shipped = [*_consumers(), *_python_files(REPO_ROOT / "libs")]
    shipped = [p for p in shipped if "tests" not in p.relative_to(REPO_ROOT).parts]
    bad = [f"{path.relative_to(REPO_ROOT)}:{line} imports {mod}" for path in shipped
           for line, mod in _imports(path) if mod.split(".")[0] in DEV_TOOLING]
    assert not bad, "service images do not ship the dev tooling:\n" + "\n".join(bad)


def test_the_library_points_down_only() -> None:
    """The library imports contracts but no service or CLI; the contracts import nothing of ours
    but each other (protoc's stubs of one proto importing another)."""
    lib = REPO_ROOT / "libs" / "examlops" / "src"
    ours = set(SERVICES.values()) | {"examlops_cli"}
    bad = [f"{p.relative_to(REPO_ROOT)}:{line} imports {mod}" for p in _python_files(lib)
           for line, mod in _imports(p) if mod.split(".")[0] in ours]
    contracts = REPO_ROOT / "libs" / "contracts" / "src"
    for path in sorted(contracts.rglob("*.py")):
        for line, mod in _imports(path):
            top = mod.split(".")
            if top[0] in ours or (top[0] == "examlops" and len(top) > 1 and top[1] not in CONTRACT_PACKAGES):
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_contracts_distribution_depends_on_protobuf_and_grpc_only() -> None:
    import tomllib

    deps = tomllib.loads((REPO_ROOT / "libs" / "contracts" / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    assert names == {"grpcio", "protobuf"}
