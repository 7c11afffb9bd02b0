"""The Dockerfiles and .dockerignore, read with a parser of the instruction grammar they use.

No Docker engine or cluster runs here; see tests/_deploy.py for what stands in.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from _deploy import ROOT, SERVICES, UID, module_of

from examlops.svc import DEFAULT_PORTS


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comment lines dropped, `\\` continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue  # a comment (also inside a continuation, as Docker does)
        if not line and not pending:
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, rest = pending.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in dockerfile_instructions(path):
        if ins[0] == "FROM":
            result.append([])
        assert result, f"{path}: {ins[0]} before the first FROM"
        result[-1].append(ins)
    return result


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, args in stage:
        if kw == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_is_multi_stage_non_root_with_healthcheck(name: str) -> None:
    path = ROOT / "services" / name / "Dockerfile"
    builder, final = stages(path)
    assert builder[0] == ("FROM", "python:3.11-slim AS builder")
    assert final[0] == ("FROM", "python:3.11-slim")
    kws = [kw for kw, _ in final]
    # Runtime: the venv comes from the builder; nothing is installed or compiled here.
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in final
    for kw, args in final:
        if kw == "RUN":
            assert not re.search(r"\b(apt-get|apt|pip|gcc|cc|make)\b", args), args
            assert re.fullmatch(r"groupadd .* && useradd .*", args), args
    # Non-root, by number, so Kubernetes' runAsNonRoot can check it without a passwd file.
    users = [args for kw, args in final if kw == "USER"]
    assert users and users[-1] == f"{UID}:{UID}"
    assert kws.index("USER") < kws.index("ENTRYPOINT")
    env = env_of(final)
    port = DEFAULT_PORTS[name]
    assert env["EXAMLOPS_HOST"] == "0.0.0.0" and env["EXAMLOPS_PORT"] == str(port)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert "EXAMLOPS_ADMIN_KEY" not in env  # a secret never goes into an image
    exposed = next(args for kw, args in final if kw == "EXPOSE").split()
    assert exposed[0] == str(port)
    [healthcheck] = [args for kw, args in final if kw == "HEALTHCHECK"]
    options, _, command = healthcheck.partition(" CMD ")
    assert "--start-period=" in options
    probe = exec_form(command)
    if name == "gateway":
        assert f"http://127.0.0.1:{port}/healthz" in probe[-1]
    else:
        assert probe == ["python", "-m", "examlops.svc.healthcheck", f"127.0.0.1:{port}"]
        assert env["EXAMLOPS_METRICS_PORT"] == "9090" and "9090" in exposed
    [entrypoint] = [args for kw, args in final if kw == "ENTRYPOINT"]
    module = module_of(name)
    assert exec_form(entrypoint) == ["python", "-m", module]
    assert (ROOT / "services" / name / "src" / module / "__main__.py").is_file()
    if name in ("launcher", "engine-proxy"):
        assert ("COPY", "usecases /opt/examlops/usecases") in final
        assert env["EXAMLOPS_USECASE_DIR"] == "/opt/examlops/usecases"


def test_dockerfiles_share_one_builder_recipe() -> None:
    recipes = {}
    for name in SERVICES:
        builder = stages(ROOT / "services" / name / "Dockerfile")[0]
        recipes[name] = [(kw, args.replace(f"services/{name}", "services/<name>")) for kw, args in builder]
    reference = recipes["registry"]
    assert ("RUN", "/opt/venv/bin/pip install /src/libs/examlops /src/services/<name>") in reference
    for name, recipe in recipes.items():
        assert recipe == reference, name


def dockerignore_included(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        for piece in re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/")):
            out += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(piece, re.escape(piece))
        return re.compile(out)

    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for raw in patterns:
        negate = raw.startswith("!")
        rx = regex(raw[1:] if negate else raw)
        if any(rx.fullmatch(p) for p in prefixes):
            included = negate
    return included


def test_dockerignore_sends_what_the_dockerfiles_copy_and_nothing_private() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert patterns[0] == "*", "the context is an allow-list"
    needed = []
    for name in SERVICES:
        for kw, args in dockerfile_instructions(ROOT / "services" / name / "Dockerfile"):
            if kw == "COPY" and not args.startswith("--from"):
                source = args.split()[0]
                assert (ROOT / source).exists(), source
                needed.append(source)
    for source in set(needed):
        for file in (ROOT / source).rglob("*"):
            rel = file.relative_to(ROOT).as_posix()
            wanted = (file.suffix in (".py", ".toml", ".yaml", ".pyi") and "/tests/" not in f"/{rel}"
                      and "/bench/" not in f"/{rel}" and "__pycache__" not in rel and ".egg-info" not in rel)
            if file.is_file() and wanted:
                assert dockerignore_included(patterns, rel), f"{rel} is copied but ignored"
    for private in (".venv/bin/python", ".git/config", ".env", ".run/logs/x.log", "services/gateway/tests/test_x.py",
                    "libs/examlops/tests/conftest.py", "services/mediaguard/bench/b.py",
                    "libs/examlops/src/examlops/__pycache__/x.pyc", "cli/pyproject.toml"):
        assert not dockerignore_included(patterns, private), private
