"""Compile the lock each service image installs from: services/<name>/requirements.lock (`make lock`).

A lock pins, with hashes, every third-party distribution of one image: the runtime dependencies of
the service and of the local libraries it depends on, read from their pyproject.toml files, and
the build backend that installs those local packages. The local packages are not in it: the
Dockerfile installs the lock with `pip install --require-hashes --no-deps`, then the local
packages with `--no-deps --no-index`. The images run CPython 3.11 on x86_64 Debian (glibc), so
the locks are resolved for that platform, wheels only, whatever machine runs this.

The first line of a lock records a digest of its inputs; tests/test_dockerfiles.py recomputes it,
so a pyproject edit without `make lock` fails the tests. Needs the network (PyPI) and `uv`.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("registry", "launcher", "mediaguard", "engine-proxy", "gateway")
# Where local distributions live; tools/ and cli/ are listed so that a service depending on one
# of them is seen as depending on a local package (and the tests then reject it), not on PyPI.
LOCAL_PROJECT_GLOBS = ("libs/*/pyproject.toml", "services/*/pyproject.toml", "tools/*/pyproject.toml",
                       "cli/pyproject.toml")
PYTHON_VERSION = "3.11"
PYTHON_PLATFORM = "x86_64-manylinux_2_28"
INPUTS_PREFIX = "# inputs: sha256:"


def lock_path(service: str) -> Path:
    return ROOT / "services" / service / "requirements.lock"


def _pyproject(project: Path) -> dict[str, Any]:
    return tomllib.loads((project / "pyproject.toml").read_text())


def local_projects() -> dict[str, Path]:
    """Canonical distribution name -> project folder, for every package that lives in this repository."""
    found: dict[str, Path] = {}
    for pattern in LOCAL_PROJECT_GLOBS:
        for file in sorted(ROOT.glob(pattern)):
            found[canonicalize_name(tomllib.loads(file.read_text())["project"]["name"])] = file.parent
    return found


def install_set(service: str) -> list[Path]:
    """The local project folders an image of `service` installs: the service and every local dependency."""
    local = local_projects()
    seen: list[Path] = []
    todo = [ROOT / "services" / service]
    while todo:
        project = todo.pop()
        if project in seen:
            continue
        seen.append(project)
        for spec in _pyproject(project)["project"].get("dependencies", []):
            name = canonicalize_name(Requirement(spec).name)
            if name in local:
                todo.append(local[name])
    return sorted(seen, key=lambda p: p.relative_to(ROOT).as_posix())


def third_party_requirements(service: str) -> list[str]:
    """The requirement strings the lock must satisfy: runtime and build requirements of the install set."""
    local = local_projects()
    specs: set[str] = set()
    for project in install_set(service):
        data = _pyproject(project)
        for spec in [*data["project"].get("dependencies", []), *data["build-system"]["requires"]]:
            if canonicalize_name(Requirement(spec).name) not in local:
                specs.add(str(Requirement(spec)))
    return sorted(specs)


def inputs_digest(service: str) -> str:
    text = "\n".join([f"python {PYTHON_VERSION} {PYTHON_PLATFORM}", *third_party_requirements(service)])
    return hashlib.sha256(text.encode()).hexdigest()


def compile_lock(service: str) -> str:
    uv = Path(sys.executable).parent / "uv"
    argv = [str(uv), "pip", "compile", "-", "--quiet", "--no-config", "--generate-hashes",
            "--python-version", PYTHON_VERSION, "--python-platform", PYTHON_PLATFORM,
            "--only-binary", ":all:", "--custom-compile-command", "make lock"]
    out = subprocess.run(argv, input="\n".join(third_party_requirements(service)) + "\n",
                         capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"uv pip compile for {service} failed:\n{out.stderr}")
    return f"{INPUTS_PREFIX}{inputs_digest(service)}\n{out.stdout}"


def main(argv: list[str]) -> int:
    for service in argv or SERVICES:
        path = lock_path(service)
        path.write_text(compile_lock(service))
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
