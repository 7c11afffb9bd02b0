"""Quantization methods of `exa models quantize`, and the quantizer that runs them.

The quantizer is llm-compressor in its own virtual environment (scripts/quant-env.sh builds it
under the user's cache directory; its pins clash with vLLM's), so `run_quantizer` starts that
environment's python on `quantize_worker.py` and reads back one JSON line. Which methods this
host's CPU vLLM serves, and how fast, was measured on SmolLM2 (see `servable_here`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LLMCOMPRESSOR_VERSION = "0.14.0.1"
QUANT_TORCH_VERSION = "2.13.0+cpu"
QUANT_VENV_ENV = "EXAMLOPS_QUANT_VENV"
WORKER = Path(__file__).with_name("quantize_worker.py")
GROUP_SIZES = (128, 64, 32)

_WNA16 = "CPU vLLM serves 4-bit weight-only checkpoints with its WNA16 kernel (CPUWNA16)"


@dataclass(frozen=True)
class QuantMethod:
    """One method: what it does, what it needs, and the scheme its checkpoint records."""

    name: str
    summary: str
    scheme: str
    needs_calibration: bool      # refused without calibration data
    accepts_calibration: bool    # calibration data changes the recipe (SmoothQuant/GPTQ instead of round-to-nearest)


METHODS: dict[str, QuantMethod] = {m.name: m for m in (
    QuantMethod("w8a8", "int8 weights per channel, int8 activations per token at run time; with calibration "
                "data SmoothQuant(0.8) then GPTQ", "W8A8", needs_calibration=False, accepts_calibration=True),
    QuantMethod("w4a16", "int4 weights in groups (128/64/32, whichever divides the model), activations kept in "
                "bf16; round-to-nearest, or GPTQ with calibration data", "W4A16", needs_calibration=False,
                accepts_calibration=True),
    QuantMethod("fp8", "FP8 (e4m3) weights per channel, FP8 activations per token at run time; data-free",
                "FP8_DYNAMIC", needs_calibration=False, accepts_calibration=False),
    QuantMethod("gptq", "int4 group weights placed by GPTQ from calibration activations (W4A16)", "W4A16",
                needs_calibration=True, accepts_calibration=True),
    QuantMethod("awq", "activation-aware scaling of salient channels, then asymmetric int4 group weights",
                "W4A16_ASYM", needs_calibration=True, accepts_calibration=True),
)}


class QuantizeError(RuntimeError):
    """The quantizer refused or failed; the message is the reason, in one line."""


@dataclass(frozen=True)
class QuantResult:
    """What the quantizer did: the worker's JSON line, and where the checkpoint is."""

    out: Path
    method: str
    scheme: str
    recipe: list[dict[str, Any]]
    calibration: dict[str, Any] | None
    tools: dict[str, str]
    seconds: float
    peak_rss_mb: int
    workarounds: tuple[str, ...] = ()

    def parameters(self) -> dict[str, Any]:
        """The record of the run, as plain JSON (what a BOM's quantization parameters hold)."""
        return {"method": self.method, "scheme": self.scheme, "recipe": self.recipe,
                "calibration": self.calibration, "tools": self.tools, "workarounds": list(self.workarounds)}


def method(name: str) -> QuantMethod:
    try:
        return METHODS[name]
    except KeyError:
        raise QuantizeError(f"unknown quantization method {name!r} (known: {', '.join(METHODS)})") from None


def choose_group_size(*dims: int) -> int:
    """The largest of 128/64/32 dividing every dimension (SmolLM2-135M: 576 and 1536 -> 64)."""
    for size in GROUP_SIZES:
        if all(d % size == 0 for d in dims):
            return size
    raise QuantizeError(f"no group size of {'/'.join(map(str, GROUP_SIZES))} divides the model's dimensions {dims}")


def quant_venv_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the quantizer venv is: $EXAMLOPS_QUANT_VENV, else where scripts/quant-env.sh builds it."""
    from examlops.engine import cached_venv_dir

    return cached_venv_dir(QUANT_VENV_ENV, f"llmcompressor-{LLMCOMPRESSOR_VERSION}-torch-{QUANT_TORCH_VERSION}",
                           environ)


def quantizer_python(environ: Mapping[str, str] | None = None) -> Path | None:
    """The python of a complete quantizer venv, or None when this host has none."""
    venv = quant_venv_dir(environ)
    python = venv / "bin" / "python"
    return python if (venv / ".complete").is_file() and python.is_file() else None


def _no_quantizer_reason(environ: Mapping[str, str] | None = None) -> str:
    return (f"no quantizer environment at {quant_venv_dir(environ)}: build it with scripts/quant-env.sh, "
            f"or point {QUANT_VENV_ENV} at one")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags, from /proc/cpuinfo (or the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def servable_here(name: str, *, cpuinfo: str | None = None,
                  environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether this host's CPU vLLM serves what `name` produces, and why (measured on vLLM 0.32).

    A host without the quantizer environment cannot make the checkpoint at all: the answer is
    False with a reason starting "degraded:" (the quantization is recorded, not run).
    """
    chosen = method(name)
    if quantizer_python(environ) is None:
        return False, f"degraded: {_no_quantizer_reason(environ)}"
    if chosen.name == "w8a8":
        return True, "CPU vLLM serves W8A8 with its int8 scaled-mm kernel (CPUInt8ScaledMM)"
    if chosen.name == "fp8":
        if "amx_tile" in cpu_flags(cpuinfo):
            return True, "CPU vLLM serves FP8 checkpoints; this CPU has AMX (amx_tile), which its fast FP8 path needs"
        return False, ("CPU vLLM runs FP8 checkpoints, but at about 2 tok/s without AMX (this CPU has no amx_tile "
                       "flag); w8a8 serves faster than bf16 here")
    return True, _WNA16


def degraded_reason(environ: Mapping[str, str] | None = None) -> str:
    """Why quantizing here would be recorded rather than run ("" when the quantizer is here)."""
    return "" if quantizer_python(environ) is not None else _no_quantizer_reason(environ)


def _worker_error(lines: list[str], returncode: int) -> str:
    """The worker's own one-line reason (its last `error: ` line), else the end of what it said."""
    for line in reversed(lines):
        if line.startswith("error: "):
            return line.removeprefix("error: ")
    tail = " | ".join(line for line in lines[-3:] if line.strip())
    return f"the quantizer exited with code {returncode}" + (f": {tail}" if tail else " and said nothing")


def _clear(out: Path, created: bool) -> None:
    """Leave no half-written checkpoint: remove what this run made (the folder too, if it made it)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in out.iterdir() if out.is_dir() else ():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _parse_result(stdout: str, out: Path) -> QuantResult:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise QuantizeError("the quantizer succeeded but printed no result line")
    try:
        data = json.loads(lines[-1])
        return QuantResult(out=out, method=str(data["method"]), scheme=str(data["scheme"]), recipe=list(data["recipe"]),
                           calibration=data["calibration"], tools=dict(data["tools"]), seconds=float(data["seconds"]),
                           peak_rss_mb=int(data["peak_rss_mb"]), workarounds=tuple(data.get("workarounds", ())))
    except (ValueError, KeyError, TypeError) as exc:
        raise QuantizeError(f"the quantizer's result line is not the expected JSON ({exc}): "
                            f"{lines[-1][:200]}") from None


def run_quantizer(name: str, src: Path, out: Path, calibration: Path | None = None, *,
                  samples: int | None = None, seed: int = 0, progress: Callable[[str], None] | None = None,
                  python: Path | None = None, timeout: float | None = None) -> QuantResult:
    """Quantize the model folder `src` into `out` with the quantizer venv; QuantizeError on any failure.

    The worker's stderr lines go to `progress` as they come. `out` must not exist or be empty;
    on failure nothing the run wrote is left there.
    """
    chosen = method(name)
    src, out = Path(src), Path(out)
    if calibration is None and chosen.needs_calibration:
        raise QuantizeError(f"method {chosen.name} needs calibration data (a text or JSONL file)")
    if calibration is not None and not chosen.accepts_calibration:
        raise QuantizeError(f"method {chosen.name} is data-free: it takes no calibration data")
    if calibration is not None and not Path(calibration).is_file():
        raise QuantizeError(f"calibration file not found: {calibration}")
    if not (src / "config.json").is_file():
        raise QuantizeError(f"{src} is not a model folder (no config.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QuantizeError(f"output folder {out} exists and is not empty: choose a new one")
    python = python or quantizer_python()
    if python is None:
        raise QuantizeError(_no_quantizer_reason())

    argv = [str(python), str(WORKER), "--method", chosen.name, "--src", str(src), "--out", str(out),
            "--seed", str(seed)]
    if calibration is not None:
        argv += ["--calibration", str(calibration)]
    if samples is not None:
        argv += ["--samples", str(samples)]
    # Local folders only: nothing to fetch, and line-by-line stderr for the progress callback.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    created = not out.exists()
    stderr_lines: list[str] = []
    stdout_parts: list[str] = []
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", env=env)
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout, proc.stderr
    reader = threading.Thread(target=lambda: stdout_parts.append(stdout.read()), daemon=True)
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout, stop) if timeout else None
    try:
        reader.start()
        if timer is not None:
            timer.start()
        for raw in stderr:
            line = raw.rstrip("\n")
            if not line.strip():
                continue  # progress bars redraw with carriage returns, which arrive as empty lines
            stderr_lines.append(line)
            del stderr_lines[:-200]
            if progress is not None:
                progress(line)
        returncode = proc.wait()
        reader.join()
    except BaseException:
        proc.kill()
        proc.wait()
        _clear(out, created)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        stdout.close()
        stderr.close()
    if timed_out.is_set():
        _clear(out, created)
        raise QuantizeError(f"the quantizer took longer than {timeout:g} s and was stopped")
    if returncode != 0:
        _clear(out, created)
        raise QuantizeError(_worker_error(stderr_lines, returncode))
    try:
        return _parse_result("".join(stdout_parts), out)
    except QuantizeError:
        _clear(out, created)
        raise
