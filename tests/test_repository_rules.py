"""Rules over the repository's own files.

The repository stands alone: no test or source file reaches a path outside the checkout (a
folder beside it, the machine's own layout), so a fresh clone tests on its own. Data from
elsewhere is vendored under third_party/ with its license and the exact upstream file.
Every YAML document the project writes goes through `examlops.yamlio.dump_yaml` (no anchors).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
KSERVE = ROOT / "third_party" / "kserve"
#: SHA-256 of KServe's CRD at the upstream commit named in third_party/kserve/README.md.
KSERVE_CRD_SHA256 = "fbd625c2a2ac7b79e17c9763b7a0c4acf3cd3eaa99ebf0fab06db008785b35f3"
KSERVE_COMMIT = "aaac4e294dae2c7b1aa1886447793f3aa1c30912"

SOURCE_SUFFIXES = {".py", ".pyi", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".j2", ".txt", ".lua"}
SOURCE_NAMES = {"Makefile", "Dockerfile", ".dockerignore", "conftest.py"}

# `Path(__file__)` (resolved or not) followed by `.parent`s or `.parents[N]`.
FILE_CHAIN = re.compile(r"Path\(__file__\)(?:\.resolve\(\)|\.absolute\(\))?((?:\.parent\b(?!s))+|\.parents\[(\d+)\])")
ASSIGN = re.compile(r"^([A-Za-z_]\w*)\s*(?::\s*\w+\s*)?=\s*(.+)$", re.MULTILINE)


def project_files() -> list[str]:
    """Tracked files and new files not ignored, minus vendored third-party data."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    files = [f for f in out.stdout.split("\0") if f and not f.startswith("third_party/") and (ROOT / f).is_file()]
    return [f for f in files if Path(f).suffix in SOURCE_SUFFIXES or Path(f).name in SOURCE_NAMES
            or Path(f).name.startswith("Dockerfile")]


def climb(chain: str) -> int:
    """How many directories `.parent.parent` / `.parents[N]` climbs."""
    if m := re.fullmatch(r"\.parents\[(\d+)\]", chain):
        return int(m.group(1)) + 1
    return chain.count(".parent")


def escapes(rel: str, text: str) -> list[str]:
    """Paths built from `__file__` (directly or through a module constant) that land above the root."""
    depth = len(Path(rel).parts)  # climbing more directories than this from the file leaves the checkout
    # constant -> directories climbed from the file's own path; a `*ROOT` not built here (e.g.
    # examlops_testsupport.REPO_ROOT) names the repository root.
    levels: dict[str, int] = {name: depth for name in re.findall(r"\b([A-Z_]*ROOT)\b", text)}
    for name, value in ASSIGN.findall(text):
        if m := FILE_CHAIN.match(value):
            levels[name] = climb(m.group(1))
        elif (m := re.match(r"([A-Za-z_]\w*)((?:\.parent\b(?!s))+|\.parents\[\d+\])?", value)) and m.group(1) in levels:
            levels[name] = levels[m.group(1)] + (climb(m.group(2)) if m.group(2) else 0)
    found = [m.group(0) for m in FILE_CHAIN.finditer(text) if climb(m.group(1)) > depth]
    for name, climbed in levels.items():
        for m in re.finditer(rf"\b{re.escape(name)}((?:\.parent\b(?!s))+|\.parents\[\d+\])", text):
            if climbed + climb(m.group(1)) > depth:
                found.append(m.group(0))
    return found


def test_no_file_reaches_outside_the_repository() -> None:
    # Literal references: the folder beside the checkout the KServe CRD used to be read from, and
    # this checkout's own absolute path (a clone elsewhere would not have it).
    literals = ["shared/reference", '"shared" / "reference"']
    if len(ROOT.parts) > 2:
        literals.append(f"{ROOT}/")
    problems = []
    files = project_files()
    assert len(files) > 50 and "tests/test_repository_rules.py" in files
    for rel in files:
        if rel == THIS:
            continue
        text = (ROOT / rel).read_text(encoding="utf-8", errors="replace")
        problems += [f"{rel}: {lit!r}" for lit in literals if lit in text]
        if rel.endswith((".py", ".pyi")):
            problems += [f"{rel}: {e} leaves the repository" for e in escapes(rel, text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("rel", "text", "bad"), [
    ("tests/t.py", "ROOT = Path(__file__).resolve().parent.parent\nX = ROOT / 'usecases'\n", False),
    ("tests/t.py", "ROOT = Path(__file__).resolve().parent.parent\nX = ROOT.parent / 'shared'\n", True),
    ("tests/t.py", "X = Path(__file__).resolve().parents[2] / 'shared'\n", True),
    ("libs/a/tests/t.py", "REPO = Path(__file__).resolve().parents[3]\n", False),
    ("libs/a/tests/t.py", "REPO = Path(__file__).resolve().parents[4]\n", True),
    ("bench/b.py", "BENCH = Path(__file__).resolve().parent\nROOT = BENCH.parent\nX = ROOT.parent\n", True),
    ("bench/b.py", "BENCH = Path(__file__).resolve().parent\nROOT = BENCH.parent\n", False),
    ("services/a/tests/t.py", "from examlops_testsupport import REPO_ROOT\nROOT = REPO_ROOT\nX = ROOT.parent\n", True),
    ("services/a/tests/t.py", "from examlops_testsupport import REPO_ROOT\nX = REPO_ROOT / 'usecases'\n", False),
])
def test_the_escape_check_sees_escapes(rel: str, text: str, bad: bool) -> None:
    # The control for the rule above: it tells an escape from a path inside the checkout.
    assert bool(escapes(rel, text)) is bad


def test_the_vendored_kserve_crd_is_the_upstream_file_with_its_license() -> None:
    crd = KSERVE / "serving.kserve.io_llminferenceservices.yaml"
    assert hashlib.sha256(crd.read_bytes()).hexdigest() == KSERVE_CRD_SHA256
    assert "Apache License" in (KSERVE / "LICENSE").read_text()
    for note in ("NOTICE", "README.md"):
        text = (KSERVE / note).read_text()
        assert KSERVE_COMMIT in text and "kserve/kserve" in text, note
    assert KSERVE_CRD_SHA256 in (KSERVE / "README.md").read_text()


def test_every_yaml_document_is_written_by_the_one_helper() -> None:
    # yaml.dump and yaml.safe_dump write anchors for shared objects; dump_yaml never does.
    writer = re.compile(r"\byaml\.(?:safe_)?dump(?:_all)?\s*\(|\bDumper\s*=")
    allowed = "libs/examlops/src/examlops/yamlio.py"
    offenders = [rel for rel in project_files()
                 if rel.endswith(".py") and rel != allowed and "tests/" not in rel and "bench/" not in rel
                 and writer.search((ROOT / rel).read_text(encoding="utf-8"))]
    assert not offenders, f"write YAML with examlops.yamlio.dump_yaml: {offenders}"
