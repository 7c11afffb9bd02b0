"""Quantize a model folder with llm-compressor. Runs as a script in the quantizer's own venv.

Executed by the python of the environment scripts/quant-env.sh builds (llm-compressor, torch,
transformers), where examlops is not installed: it imports the standard library at module level
and the heavy libraries only inside functions, so the CLI's tests can also load it to check its
pure parts (the method table, the group size, the recipe, the calibration reader).

    python quantize_worker.py --method M --src DIR --out DIR [--calibration FILE] [--samples N] [--seed S]

Progress goes to stderr; the one and only stdout line is the JSON result (method, scheme, recipe,
calibration, tool versions, library workarounds applied, seconds, peak RSS). Any failure exits
with code 2, the last stderr line starting with ``error: ``, and no output folder it created.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

#: method -> (scheme written into the checkpoint, needs calibration data). Mirrors _methods.METHODS.
METHODS: dict[str, tuple[str, bool]] = {
    "w8a8": ("W8A8", False),
    "w4a16": ("W4A16", False),
    "fp8": ("FP8_DYNAMIC", False),
    "gptq": ("W4A16", True),
    "awq": ("W4A16_ASYM", True),
}
GROUP_SIZES = (128, 64, 32)
MAX_LENGTH = 512
IGNORE = ["lm_head"]
#: Files the model folder carries beside the weights that save_pretrained does not rewrite.
SIDE_FILES = ("chat_template.jinja", "generation_config.json")
TOOLS = ("llmcompressor", "torch", "transformers", "compressed-tensors")


class WorkerError(Exception):
    """A failure the user can act on: reported as one line, exit code 2."""


def log(message: str) -> None:
    sys.stderr.write(f"quantize: {message}\n")
    sys.stderr.flush()


def group_size_for(*dims: int) -> int:
    """The largest of 128/64/32 dividing every dimension (group quantization splits rows into groups)."""
    for size in GROUP_SIZES:
        if all(d % size == 0 for d in dims):
            return size
    raise WorkerError(f"no group size of {'/'.join(map(str, GROUP_SIZES))} divides the model's dimensions {dims}")


def _int4_weights(group_size: int, symmetric: bool) -> dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size}


def recipe_for(method: str, *, calibrated: bool, group_size: int) -> list[dict[str, Any]]:
    """The modifiers of a method as plain JSON: ``{"modifier": class name, **keyword arguments}``.

    This list is both what the result reports and what `build_modifiers` instantiates, so the
    recorded recipe is exactly the one that ran.
    """
    if method not in METHODS:
        raise WorkerError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    scheme, needs_data = METHODS[method]
    if needs_data and not calibrated:
        raise WorkerError(f"method {method} needs calibration data: pass --calibration FILE")
    common: dict[str, Any] = {"targets": ["Linear"], "ignore": list(IGNORE)}
    int4 = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": _int4_weights(group_size, True)}}}
    if method == "w8a8":
        if not calibrated:
            return [{"modifier": "QuantizationModifier", "scheme": scheme, **common}]
        return [{"modifier": "SmoothQuantModifier", "smoothing_strength": 0.8},
                {"modifier": "GPTQModifier", "scheme": scheme, **common}]
    if method == "fp8":
        if calibrated:
            raise WorkerError("method fp8 is data-free: it takes no calibration data")
        return [{"modifier": "QuantizationModifier", "scheme": scheme, **common}]
    if method in ("w4a16", "gptq"):
        # The W4A16 preset's group size (128) does not divide every model's widths (576 for
        # SmolLM2-135M), so the scheme is spelled out with a group size that does.
        name = "GPTQModifier" if calibrated else "QuantizationModifier"
        return [{"modifier": name, "ignore": list(IGNORE), **int4}]
    # awq: the AWQ transform scales salient channels, then plain asymmetric int4 group quantization.
    return [{"modifier": "AWQModifier", "duo_scaling": True},
            {"modifier": "QuantizationModifier", "ignore": list(IGNORE),
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": _int4_weights(group_size, False)}}}]


def build_modifiers(recipe: list[dict[str, Any]]) -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    classes = {c.__name__: c for c in (GPTQModifier, QuantizationModifier, AWQModifier, SmoothQuantModifier)}
    return [classes[step["modifier"]](**{k: v for k, v in step.items() if k != "modifier"}) for step in recipe]


def read_calibration(path: Path) -> list[str]:
    """Texts of a calibration file: one per line, or JSONL objects with a "text" field."""
    if not path.is_file():
        raise WorkerError(f"calibration file not found: {path}")
    texts = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkerError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str) or not record["text"].strip():
                raise WorkerError(f"{path}:{number}: a JSONL line needs a non-empty \"text\" string")
            texts.append(record["text"])
        else:
            texts.append(line)
    if not texts:
        raise WorkerError(f"calibration file {path} has no text")
    return texts


def pick_samples(texts: list[str], samples: int | None, seed: int) -> list[str]:
    """All texts, or a seeded random choice of `samples` of them (same seed, same choice)."""
    if samples is None or samples >= len(texts):
        return list(texts)
    if samples < 1:
        raise WorkerError(f"--samples must be at least 1 (got {samples})")
    return random.Random(seed).sample(texts, samples)


def _model_dims(src: Path) -> tuple[int, ...]:
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise WorkerError(f"cannot read {src / 'config.json'}: {exc}") from None
    config = config.get("text_config", config)
    dims = tuple(int(config[k]) for k in ("hidden_size", "intermediate_size") if k in config)
    if not dims:
        raise WorkerError(f"{src / 'config.json'} names neither hidden_size nor intermediate_size")
    return dims


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Keep stdout for the result line alone, whatever the libraries print (at the file-descriptor level)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _cpu_only_workarounds(method: str) -> list[str]:
    """Library fixes this CPU-only host needs; each is named in the result, so the record says it ran.

    llm-compressor 0.14.0.1's AWQ pins its cached activations (`IntermediatesCache.pin_memory`)
    for faster host-to-device copies, unconditionally; pinning needs an accelerator, so on a
    CPU-only torch AWQ stops with "Cannot access accelerator device when none is available".
    With no device to copy to, skipping the pin changes nothing else.
    """
    import torch

    if method != "awq" or torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not hasattr(IntermediatesCache, "pin_memory"):
        return []

    def pin_nothing(self: Any, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = pin_nothing
    return ["llmcompressor IntermediatesCache.pin_memory skipped: pinning needs an accelerator, this host has none"]


def _tool_versions() -> dict[str, str]:
    versions = {}
    for name in TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def quantize(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    src, out = Path(args.src), Path(args.out)
    if not (src / "config.json").is_file():
        raise WorkerError(f"{src} is not a model folder (no config.json)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise WorkerError(f"output folder {out} exists and is not empty")
    calibration = Path(args.calibration) if args.calibration else None
    texts = pick_samples(read_calibration(calibration), args.samples, args.seed) if calibration else []
    group_size = group_size_for(*_model_dims(src)) if args.method in ("w4a16", "gptq", "awq") else 0
    recipe = recipe_for(args.method, calibrated=calibration is not None, group_size=group_size)
    log(f"recipe: {json.dumps(recipe)}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    log(f"loading {src} (bfloat16)")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(src)

    from llmcompressor import oneshot

    workarounds = _cpu_only_workarounds(args.method)
    for note in workarounds:
        log(f"workaround: {note}")
    kwargs: dict[str, Any] = {}
    if texts:
        from datasets import Dataset

        encoded = tokenizer(texts, max_length=MAX_LENGTH, truncation=True, add_special_tokens=False)
        kwargs = {"dataset": Dataset.from_dict({"input_ids": encoded["input_ids"],
                                                "attention_mask": encoded["attention_mask"]}),
                  "num_calibration_samples": len(texts), "max_seq_length": MAX_LENGTH,
                  "shuffle_calibration_samples": False}
        log(f"calibrating on {len(texts)} texts from {calibration}")
    oneshot(model=model, tokenizer=tokenizer, recipe=build_modifiers(recipe), **kwargs)

    log(f"saving the compressed checkpoint to {out}")
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    for name in SIDE_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy2(src / name, out / name)
    config = json.loads((out / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "compressed-tensors":
        raise WorkerError(f"the saved config.json has no compressed-tensors quantization_config (got {quant!r})")
    return {
        "method": args.method,
        "scheme": METHODS[args.method][0],
        "recipe": recipe,
        "calibration": {"file": str(calibration), "samples": len(texts)} if calibration else None,
        "tools": _tool_versions(),
        "workarounds": workarounds,
        "seconds": round(time.monotonic() - started, 1),
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"usage: {message}")


def fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="quantize_worker.py", description="Quantize a model folder with llm-compressor.")
    parser.add_argument("--method", required=True, choices=sorted(METHODS))
    parser.add_argument("--src", required=True, help="the bf16 model folder")
    parser.add_argument("--out", required=True, help="where to write the compressed checkpoint")
    parser.add_argument("--calibration", help="text file (one text a line) or JSONL with a \"text\" field")
    parser.add_argument("--samples", type=int, help="how many calibration texts to use (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    created = not Path(args.out).exists()
    try:
        with _stdout_to_stderr():
            result = quantize(args)
    except Exception as exc:
        if created:  # no half-written checkpoint left behind
            shutil.rmtree(args.out, ignore_errors=True)
        if isinstance(exc, WorkerError):
            fail(str(exc))
        import traceback  # a library failure: its traceback for the log, its type and message as the line

        traceback.print_exc(file=sys.stderr)
        fail(f"{type(exc).__name__}: {exc}")
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
