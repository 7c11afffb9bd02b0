"""services/Dockerfile (one recipe, SERVICE picks the image), the locks it installs, and .dockerignore.

Read with a parser of the instruction grammar the Dockerfile uses: no Docker engine or cluster
runs here; see tests/_deploy.py for what stands in. The locks are checked against the pyproject
files without the network.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from examlops.svc import DEFAULT_PORTS
from examlops_testsupport.deploy import ROOT, SERVICES, UID, load_script, module_of

DOCKERFILE = ROOT / "services" / "Dockerfile"
lock_images = load_script("lock_images")
# The environment of the images, for requirement markers: CPython 3.11 on x86_64 Linux.
IMAGE_ENV = {"python_version": "3.11", "python_full_version": "3.11.16", "implementation_name": "cpython",
             "implementation_version": "3.11.16", "platform_python_implementation": "CPython", "os_name": "posix",
             "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
             "platform_release": "", "platform_version": ""}


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


def substitute(text: str, values: dict[str, str]) -> str:
    """Docker's `${NAME}` / `$NAME` replacement, for the variables the recipe uses."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"${name} is not defined here"
        return values[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


@dataclass
class Stage:
    base: str  # FROM's image or the name of an earlier stage, ARGs replaced
    name: str
    body: list[tuple[str, str]] = field(default_factory=list)


def global_args() -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults."""
    args: dict[str, str] = {}
    for kw, rest in dockerfile_instructions(DOCKERFILE):
        if kw == "FROM":
            break
        assert kw == "ARG", f"{kw} before the first FROM"
        name, _, default = rest.partition("=")
        args[name] = default
    return args


def stages(service: str) -> list[Stage]:
    values = {**global_args(), "SERVICE": service}
    out: list[Stage] = []
    for kw, rest in dockerfile_instructions(DOCKERFILE):
        if kw == "FROM":
            base, _, name = substitute(rest, values).partition(" AS ")
            out.append(Stage(base, name))
        elif out:
            out[-1].body.append((kw, rest))
    return out


def env_of(body: list[tuple[str, str]], env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(env or {})
    for kw, args in body:
        if kw == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value.replace("$PATH", env.get("PATH", "$PATH"))
    return env


@dataclass
class Image:
    """What `docker build --build-arg SERVICE=<service>` makes: the final stage and the stages it stands on."""

    service: str
    builder: Stage
    chain: list[Stage]  # from the runtime base to the final stage

    @property
    def body(self) -> list[tuple[str, str]]:
        return [ins for stage in self.chain for ins in stage.body]

    def last(self, keyword: str) -> str:
        found = [args for kw, args in self.body if kw == keyword]
        assert found, f"{self.service}: no {keyword}"
        return found[-1]

    @property
    def env(self) -> dict[str, str]:
        return env_of(self.body)

    @property
    def exposed(self) -> set[str]:
        return {port for stage_env, (kw, args) in self._with_env() if kw == "EXPOSE"
                for port in substitute(args, stage_env).split()}

    def _with_env(self) -> list[tuple[dict[str, str], tuple[str, str]]]:
        out: list[tuple[dict[str, str], tuple[str, str]]] = []
        env: dict[str, str] = {}
        for kw, args in self.body:
            env = env_of([(kw, args)], env)
            out.append((env, (kw, args)))
        return out


def image(service: str) -> Image:
    all_stages = stages(service)
    by_name = {s.name: s for s in all_stages if s.name}
    chain = [all_stages[-1]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return Image(service, by_name["builder"], chain)


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def test_one_recipe_builds_every_service() -> None:
    assert not list(ROOT.glob("services/*/Dockerfile")), "the services share services/Dockerfile"
    assert global_args()["SERVICE"] in SERVICES
    assert tuple(lock_images.SERVICES) == SERVICES
    for name in SERVICES:
        assert image(name).chain[-1].base == f"service-{name}"


def test_base_image_is_python_311_slim_pinned_by_digest() -> None:
    base = global_args()["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", base), base
    for name in SERVICES:
        img = image(name)
        assert img.builder.base == base and img.chain[0].base == base
        # Every other FROM names a stage of the recipe, never an unpinned image.
        assert all(stage.base in (base, *(s.name for s in stages(name))) for stage in stages(name))


@pytest.mark.parametrize("name", SERVICES)
def test_image_is_multi_stage_non_root_with_healthcheck(name: str) -> None:
    img = image(name)
    # Runtime: the venv comes from the builder; nothing is installed or compiled here.
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in img.chain[-1].body
    for kw, args in img.body:
        if kw == "RUN":
            assert not re.search(r"\b(apt-get|apt|pip|gcc|cc|make)\b", args), args
            assert re.fullmatch(r"groupadd .* && useradd .*", args), args
        assert not (kw == "COPY" and "--from=" in args and "--from=builder " not in args), args
    # Non-root, by number, so Kubernetes' runAsNonRoot can check it without a passwd file.
    assert img.last("USER") == f"{UID}:{UID}"
    assert [kw for kw, _ in img.chain[-1].body].count("USER") == 1  # set last, after everything else
    env = img.env
    port = DEFAULT_PORTS[name]
    assert env["EXAMLOPS_HOST"] == "0.0.0.0" and env["EXAMLOPS_PORT"] == str(port)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert "EXAMLOPS_ADMIN_KEY" not in env  # a secret never goes into an image
    assert str(port) in img.exposed
    options, _, command = img.last("HEALTHCHECK").partition(" CMD ")
    assert "--start-period=" in options
    if name == "gateway":
        assert f"http://127.0.0.1:{port}/readyz" in exec_form(command)[-1]  # healthy = ready (depends_on)
        assert img.exposed == {str(port)}  # /metrics is served on the API's port
    else:
        # Shell form, expanded in the container with the image's environment.
        assert shlex.split(substitute(command, env)) == ["python", "-m", "examlops.svc.healthcheck",
                                                          f"127.0.0.1:{port}"]
        assert env["EXAMLOPS_METRICS_PORT"] == "9090" and img.exposed == {str(port), "9090"}
    module = module_of(name)
    assert exec_form(img.last("ENTRYPOINT")) == ["python", "-m", module]
    assert (ROOT / "services" / name / "src" / module / "__main__.py").is_file()
    packs = ("COPY", "usecases /opt/examlops/usecases") in img.body
    assert packs == (name in ("launcher", "engine-proxy"))
    if packs:
        assert env["EXAMLOPS_USECASE_DIR"] == "/opt/examlops/usecases"


def copies(body: list[tuple[str, str]], service: str) -> list[str]:
    """The build-context sources a stage COPYs, with SERVICE replaced."""
    return [substitute(args, {"SERVICE": service}).split()[0] for kw, args in body
            if kw == "COPY" and not args.startswith("--from")]


@pytest.mark.parametrize("name", SERVICES)
def test_builder_installs_the_lock_with_hashes_then_local_packages_without_deps(name: str) -> None:
    builder = image(name).builder.body
    runs = [substitute(args, {"SERVICE": name}) for kw, args in builder if kw == "RUN"]
    assert copies(builder, name) == [f"services/{name}/requirements.lock", "libs", f"services/{name}"]
    assert ("COPY", "services/${SERVICE}/requirements.lock /src/requirements.lock") in builder
    [locked] = [r for r in runs if "-r /src/requirements.lock" in r]
    assert {"--require-hashes", "--no-deps", "--only-binary"} <= set(locked.split())
    # The local packages: no index (nothing third-party comes in beside the lock), no dependencies.
    [local] = [r for r in runs if "/src/libs/" in r]
    first, _, check = local.partition(" && ")
    argv = first.split()
    assert argv[:2] == ["/opt/venv/bin/pip", "install"] and {"--no-index", "--no-deps"} <= set(argv)
    assert argv[-2:] == ["/src/libs/*", f"/src/services/{name}"]
    assert check == "/opt/venv/bin/pip check"
    assert runs.index(locked) < runs.index(local)


def test_install_set_is_the_contracts_the_library_and_the_service() -> None:
    for name in SERVICES:
        installed = {p.relative_to(ROOT).as_posix() for p in lock_images.install_set(name)}
        assert installed == {"libs/contracts", "libs/examlops", f"services/{name}"}, name
        # The recipe installs every folder under libs/: all of them must belong to the set.
        assert {p.relative_to(ROOT).as_posix() for p in ROOT.glob("libs/*/pyproject.toml")} == {
            f"{p}/pyproject.toml" for p in installed if p.startswith("libs/")}


def read_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, hashes), from a `--generate-hashes` requirements file."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    pins: dict[str, tuple[Version, list[str]]] = {}
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        spec, *options = (part.strip() for part in line.split(" --"))
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", spec.strip())
        assert m, f"{path.name}: not an exact pin: {line!r}"
        hashes = [o.removeprefix("hash=") for o in options if o.startswith("hash=")]
        assert len(hashes) == len(options), f"{path.name}: {line!r}"
        pins[canonicalize_name(m.group(1))] = (Version(m.group(2)), hashes)
    return pins


@pytest.mark.parametrize("name", SERVICES)
def test_lock_is_current_with_the_pyprojects(name: str) -> None:
    path = lock_images.lock_path(name)
    assert path.is_file(), f"{path} is missing: `make lock` writes it"
    header = path.read_text().splitlines()[0]
    stale = "the lock is older than its pyproject files: run `make lock`"
    assert header == f"{lock_images.INPUTS_PREFIX}{lock_images.inputs_digest(name)}", stale
    pins = read_lock(path)
    for version, hashes in pins.values():
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), version
    for spec in lock_images.third_party_requirements(name):
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate(IMAGE_ENV):
            continue
        key = canonicalize_name(req.name)
        assert key in pins, f"{name}: {spec} is not in {path.name}; {stale}"
        assert req.specifier.contains(pins[key][0], prereleases=True), f"{name}: {spec} vs {pins[key][0]}; {stale}"
    # Only third-party distributions: the local packages are installed from the context.
    assert not set(pins) & set(lock_images.local_projects()), name
    # Everything the service's own pyproject names is covered (the input set is not empty by mistake).
    own = lock_images._pyproject(ROOT / "services" / name)["project"]["dependencies"]
    assert {str(Requirement(s)) for s in own if Requirement(s).name != "examlops"} <= set(
        lock_images.third_party_requirements(name))


def dev_requirement_names() -> set[str]:
    names = {"pytest", "uv", "ruff", "mypy"}
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(canonicalize_name(Requirement(line).name))
    return names


@pytest.mark.parametrize("name", SERVICES)
def test_no_image_installs_the_dev_tooling(name: str) -> None:
    # Not copied: the recipe never COPYs tools/ or cli/, and the build context does not hold them.
    img = image(name)
    sources = copies(img.builder.body, name) + copies(img.body, name)
    assert not [s for s in sources if s.split("/")[0] in ("tools", "cli")], sources
    patterns = dockerignore_patterns()
    for dev in ("tools/devstack/pyproject.toml", "tools/devstack/src/examlops_devstack/__init__.py",
                "tools/testsupport/pyproject.toml", "cli/pyproject.toml"):
        assert not dockerignore_included(patterns, dev), dev
    # Not installed: no local package of the image is developer tooling, or ships it.
    for project in lock_images.install_set(name):
        rel = project.relative_to(ROOT).as_posix()
        assert rel.split("/")[0] in ("libs", "services"), rel
        shipped = [p.relative_to(project).as_posix() for p in (project / "src").rglob("*")
                   if p.is_dir() and p.name in ("devstack", "examlops_devstack", "testsupport", "examlops_testsupport")]
        assert not shipped, f"{rel} ships developer tooling: {shipped}"
    # Not locked: no test or development tool among the third-party pins.
    assert not set(read_lock(lock_images.lock_path(name))) & dev_requirement_names()


def dockerignore_patterns() -> list[str]:
    return [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


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


def test_dockerignore_sends_what_the_dockerfile_copies_and_nothing_private() -> None:
    patterns = dockerignore_patterns()
    assert patterns[0] == "*", "the context is an allow-list"
    needed = set()
    for name in SERVICES:
        img = image(name)
        needed |= set(copies(img.builder.body, name) + copies(img.body, name))
    for source in needed:
        assert (ROOT / source).exists(), source
        files = [ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*")
        for file in files:
            rel = file.relative_to(ROOT).as_posix()
            wanted = (file.suffix in (".py", ".toml", ".yaml", ".pyi", ".lock") and "/tests/" not in f"/{rel}"
                      and "/bench/" not in f"/{rel}" and "__pycache__" not in rel and ".egg-info" not in rel)
            if file.is_file() and wanted:
                assert dockerignore_included(patterns, rel), f"{rel} is copied but ignored"
    for private in (".venv/bin/python", ".git/config", ".env", ".run/logs/x.log", "services/gateway/tests/test_x.py",
                    "libs/examlops/tests/conftest.py", "services/mediaguard/bench/b.py",
                    "libs/examlops/src/examlops/__pycache__/x.pyc", "cli/pyproject.toml", "tools/devstack/src/x.py"):
        assert not dockerignore_included(patterns, private), private
