"""A real `vllm serve` on CPU for the tests, started from the one renderer's argv."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from examlops.engine import cached_venv_dir, find_model, render_vllm_command, require_vllm_python
from examlops_devstack import Proc, http_ok, spawn
from examlops_testsupport import REPO_ROOT
from examlops_testsupport.fixtures import free_port

ROOT = REPO_ROOT
USECASES = ROOT / "usecases"
#: The folder scripts/vllm-env.sh unpacks all-MiniLM-L6-v2 into (under the cache), and its override.
MINILM_MODEL_DIR_ENV = "EXAMLOPS_MINILM_MODEL_DIR"
MINILM_CACHE_NAME = "models/all-minilm-l6-v2-0.1.2"


def smol_model_dir() -> Path:
    value = os.environ.get("EXAMLOPS_SMOL_MODEL_DIR")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "examlops"
    path = Path(value) if value else cache / "models" / "smollm2-135m-instruct-0.1.2"
    if not (path / ".complete").is_file():
        raise RuntimeError(f"no converted SmolLM2 folder at {path}: run `make test` or scripts/vllm-env.sh")
    return path


def smol_block() -> Any:
    return find_model("smol", USECASES).engine


#: ngram speculative decoding (prompt lookup) that SmolLM2 on CPU can run: drafts come from the prompt.
NGRAM_SPEC = {"enabled": True, "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1}


def smol_spec_block() -> Any:
    """The smol block with prefix caching and ngram speculative decoding on (every vllm:prefix_cache_*
    and vllm:spec_decode_* series exists on its server)."""
    from examlops.engine import parse_engine_block

    data = smol_block().model_dump(mode="json", exclude_none=True)
    data.update(prefix_cache=True, speculative_decoding=NGRAM_SPEC)
    return parse_engine_block(data)


def minilm_model_dir() -> Path:
    """The unpacked all-MiniLM-L6-v2 folder: $EXAMLOPS_MINILM_MODEL_DIR, else where vllm-env.sh puts it."""
    path = cached_venv_dir(MINILM_MODEL_DIR_ENV, MINILM_CACHE_NAME)
    if not (path / ".complete").is_file():
        raise RuntimeError(f"no unpacked all-MiniLM-L6-v2 folder at {path}: run `make test` or scripts/vllm-env.sh")
    return path


def minilm_block() -> Any:
    """The sample pack's `minilm` engine block (task: embed, served as `minilm`)."""
    return find_model("minilm", USECASES).engine


def start_minilm_vllm(workdir: Path, port: int, log_name: str = "vllm-minilm.log") -> Proc:
    """A real `vllm serve --runner pooling` of all-MiniLM-L6-v2 on 127.0.0.1:`port` (served as minilm)."""
    return start_vllm(workdir, port, minilm_block(), log_name, model_dir=minilm_model_dir())


def start_vllm(workdir: Path, port: int, block: Any, log_name: str = "vllm.log",
               model_dir: Path | None = None) -> Proc:
    """`block` rendered and started on 127.0.0.1:`port`, loading `model_dir` (default: SmolLM2)."""
    python = require_vllm_python()
    model = str(model_dir if model_dir is not None else smol_model_dir())
    cmd = render_vllm_command(block, model=model, host="127.0.0.1", port=port)
    argv = [str(python.parent / "vllm"), *cmd.argv[1:]]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **cmd.env}
    proc = spawn("vllm", argv, env, workdir / log_name)
    deadline = time.monotonic() + 600
    while not http_ok(f"http://127.0.0.1:{port}/health"):
        proc.remember_group()  # its engine core wipes its environment: stop() finds it by this list
        if not proc.alive():
            proc.stop()  # its engine core may outlive it
            raise RuntimeError(f"vLLM exited ({proc.popen.returncode}):\n{proc.log_tail(40)}")
        if time.monotonic() > deadline:
            proc.stop()
            raise TimeoutError(f"vLLM not healthy in 600 s:\n{proc.log_tail(40)}")
        time.sleep(1)
    proc.remember_group()
    return proc


@contextlib.contextmanager
def smol_server(workdir: Path) -> Iterator[str]:
    """SmolLM2 on a real `vllm serve` on a free port, for the `with` block: its base URL."""
    port = free_port()
    proc = start_vllm(workdir, port, smol_block())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def launcher_settings(root: Path) -> dict[str, str]:
    """A launcher whose Slurm jobs run `vllm serve` from the CPU vLLM venv (the tests' settings)."""
    python = require_vllm_python()
    return {"EXAMLOPS_VLLM_WORK_DIR": str(root / "work"), "EXAMLOPS_VLLM_RUNTIME": "path",
            "EXAMLOPS_VLLM_BIN": str(python.parent / "vllm"),
            "EXAMLOPS_VLLM_JOB_ENV": json.dumps({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})}


def write_pack(root: Path, name: str) -> Path:
    """A pack holding the smol block under `name`, loading the local SmolLM2 folder."""
    data = smol_block().model_dump(mode="json", exclude_none=True)
    data.pop("base_url", None)
    data.update(hf_model_id=str(smol_model_dir()), served_model_name=name)
    models = root / "packs" / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / f"{name}.yaml").write_text(json.dumps({"engine": data}))
    return root / "packs"


def serving_rss_mb(model_path: str) -> float:
    """Resident memory (MB) of the vLLM server loading `model_path` and every process under it."""
    procs: dict[int, tuple[int, int, str]] = {}  # pid -> (ppid, rss pages, cmdline)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        procs[int(entry.name)] = (int(fields[1]), int(fields[21]), cmdline)
    roots = {pid for pid, (_, _, cmd) in procs.items() if "vllm" in cmd and model_path in cmd}
    roots = {pid for pid in roots if procs[pid][0] not in roots}
    found, frontier = set(roots), set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return sum(procs[pid][1] for pid in found) * os.sysconf("SC_PAGE_SIZE") / 1e6
