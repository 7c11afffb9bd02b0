"""The quantizer of `exa models quantize`: its method table, and `run_quantizer` for real and when it fails.

The method table and the worker's own table must agree (the worker runs in the quantizer venv
and cannot import examlops). `run_quantizer`'s failure paths use a tiny stand-in for the
quantizer's python, since an out-of-memory or a crash mid-save cannot be caused on demand; the
success path quantizes the real SmolLM2 with the real llm-compressor (tier `vllm`, where the
CPU environments are built).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from examlops.provenance import (
    METHODS,
    QUANT_VENV_ENV,
    QuantizeError,
    choose_group_size,
    degraded_reason,
    quantize_worker,
    quantizer_python,
    run_quantizer,
    servable_here,
)
from examlops_testsupport.vllm import smol_model_dir

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = ROOT / "evals" / "calibration" / "smol-calib-v1.txt"
AMX_CPU = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile amx_int8\n"
EPYC_CPU = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"


def fake_venv(root: Path) -> dict[str, str]:
    venv = root / "quant-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".complete").write_text("")
    return {QUANT_VENV_ENV: str(venv)}


def model_folder(root: Path, **config: int) -> Path:
    src = root / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"hidden_size": 576, "intermediate_size": 1536, **config}))
    return src


def stand_in_python(root: Path, script: str) -> Path:
    """An executable that takes the worker's argv (`WORKER --method … --out DIR …`) and runs `script`."""
    path = root / "fake-python"
    path.write_text("#!/usr/bin/env bash\nset -u\nshift\nwhile [ $# -gt 0 ]; do [ \"$1\" = --out ] && OUT=$2; "
                    "shift; done\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# --- the method table --------------------------------------------------------------------------

def test_the_methods_and_what_they_need() -> None:
    assert set(METHODS) == {"w8a8", "w4a16", "fp8", "gptq", "awq"}
    assert {m.name for m in METHODS.values() if m.needs_calibration} == {"gptq", "awq"}
    assert {m.name for m in METHODS.values() if not m.accepts_calibration} == {"fp8"}
    assert {m.name: m.scheme for m in METHODS.values()} == {
        "w8a8": "W8A8", "w4a16": "W4A16", "fp8": "FP8_DYNAMIC", "gptq": "W4A16", "awq": "W4A16_ASYM"}
    assert all(m.summary for m in METHODS.values())


def test_the_worker_table_is_the_same_table() -> None:
    # The worker cannot import this library: its copy must not drift.
    ours = {m.name: (m.scheme, m.needs_calibration) for m in METHODS.values()}
    assert ours == quantize_worker.METHODS
    for dims in [(576, 1536), (4096, 11008), (896, 4864), (1056, 2816), (2048, 5632), (960, 2560)]:
        assert quantize_worker.group_size_for(*dims) == choose_group_size(*dims)


@pytest.mark.parametrize(("dims", "size"), [
    ((576, 1536), 64),      # SmolLM2-135M: the W4A16 preset's 128 does not divide 576
    ((4096, 11008), 128),   # Llama-2-7B
    ((896, 4864), 128),     # Qwen2.5-0.5B
    ((960, 2560), 64),      # SmolLM2-360M
    ((1056, 2816), 32),
])
def test_group_size_is_the_largest_that_divides_every_width(dims: tuple[int, int], size: int) -> None:
    assert choose_group_size(*dims) == size


def test_no_group_size_fits() -> None:
    with pytest.raises(QuantizeError, match="no group size of 128/64/32 divides"):
        choose_group_size(576, 1000)


def test_recipes_are_what_each_method_runs() -> None:
    w4 = quantize_worker.recipe_for("w4a16", calibrated=False, group_size=64)
    assert [s["modifier"] for s in w4] == ["QuantizationModifier"]
    weights = w4[0]["config_groups"]["group_0"]["weights"]
    assert weights == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    assert w4[0]["ignore"] == ["lm_head"]
    assert [s["modifier"] for s in quantize_worker.recipe_for("w4a16", calibrated=True, group_size=64)] == [
        "GPTQModifier"]
    cal = quantize_worker.recipe_for("w8a8", calibrated=True, group_size=0)
    assert cal[0] == {"modifier": "SmoothQuantModifier", "smoothing_strength": 0.8}
    assert cal[1]["modifier"] == "GPTQModifier" and cal[1]["scheme"] == "W8A8"
    free = quantize_worker.recipe_for("w8a8", calibrated=False, group_size=0)
    assert free == [{"modifier": "QuantizationModifier", "scheme": "W8A8", "targets": ["Linear"],
                     "ignore": ["lm_head"]}]
    awq = quantize_worker.recipe_for("awq", calibrated=True, group_size=64)
    assert awq[0]["modifier"] == "AWQModifier"
    assert awq[1]["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert quantize_worker.recipe_for("fp8", calibrated=False, group_size=0)[0]["scheme"] == "FP8_DYNAMIC"
    with pytest.raises(quantize_worker.WorkerError, match="fp8 is data-free"):
        quantize_worker.recipe_for("fp8", calibrated=True, group_size=0)
    with pytest.raises(quantize_worker.WorkerError, match="gptq needs calibration data"):
        quantize_worker.recipe_for("gptq", calibrated=False, group_size=64)


def test_calibration_texts_from_lines_or_jsonl(tmp_path: Path) -> None:
    plain = tmp_path / "c.txt"
    plain.write_text("one\n\n  two  \nthree\n")
    assert quantize_worker.read_calibration(plain) == ["one", "two", "three"]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "alpha"}\n{"text": "beta", "id": 2}\n')
    assert quantize_worker.read_calibration(jsonl) == ["alpha", "beta"]
    jsonl.write_text('{"text": "alpha"}\n{"body": "no text"}\n')
    with pytest.raises(quantize_worker.WorkerError, match=r"c\.jsonl:2: .*\"text\""):
        quantize_worker.read_calibration(jsonl)
    texts = quantize_worker.read_calibration(CALIBRATION)
    assert len(texts) == 32
    picked = quantize_worker.pick_samples(texts, 8, seed=7)
    assert picked == quantize_worker.pick_samples(texts, 8, seed=7) and len(set(picked)) == 8
    assert picked != quantize_worker.pick_samples(texts, 8, seed=8)
    assert quantize_worker.pick_samples(texts, None, seed=0) == texts


# --- where it runs and what this host serves ---------------------------------------------------

def test_quantizer_python_from_the_variable_or_the_cache(tmp_path: Path) -> None:
    env = fake_venv(tmp_path)
    assert quantizer_python(env) == Path(env[QUANT_VENV_ENV]) / "bin" / "python"
    (Path(env[QUANT_VENV_ENV]) / ".complete").unlink()
    assert quantizer_python(env) is None  # half-built: not used
    cache = tmp_path / "cache"
    built = cache / "llmcompressor-0.14.0.1-torch-2.13.0+cpu"
    (built / "bin").mkdir(parents=True)
    (built / "bin" / "python").write_text("")
    (built / ".complete").write_text("")
    assert quantizer_python({"EXAMLOPS_CACHE_DIR": str(cache)}) == built / "bin" / "python"


def test_what_this_host_serves(tmp_path: Path) -> None:
    env = fake_venv(tmp_path)
    for name in ("w8a8", "w4a16", "gptq", "awq"):
        ok, reason = servable_here(name, cpuinfo=EPYC_CPU, environ=env)
        assert ok, reason
    assert "Int8ScaledMM" in servable_here("w8a8", cpuinfo=EPYC_CPU, environ=env)[1]
    assert "WNA16" in servable_here("awq", cpuinfo=EPYC_CPU, environ=env)[1]
    ok, reason = servable_here("fp8", cpuinfo=EPYC_CPU, environ=env)
    assert not ok and "2 tok/s" in reason and "amx_tile" in reason
    assert servable_here("fp8", cpuinfo=AMX_CPU, environ=env)[0]


def test_no_quantizer_environment_means_degraded(tmp_path: Path) -> None:
    env = {QUANT_VENV_ENV: str(tmp_path / "missing")}
    for name in METHODS:
        ok, reason = servable_here(name, cpuinfo=AMX_CPU, environ=env)
        assert not ok and reason.startswith("degraded: ") and "scripts/quant-env.sh" in reason
    assert "scripts/quant-env.sh" in degraded_reason(env)
    assert degraded_reason(fake_venv(tmp_path)) == ""
    with pytest.raises(QuantizeError, match="unknown quantization method 'int3'"):
        servable_here("int3", environ=env)


# --- run_quantizer when it must refuse or fails ------------------------------------------------

def test_an_existing_output_folder_is_refused_before_anything_runs(tmp_path: Path) -> None:
    src = model_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("someone's work")
    ran = tmp_path / "ran"
    python = stand_in_python(tmp_path, f"touch {ran}\n")
    with pytest.raises(QuantizeError, match="exists and is not empty"):
        run_quantizer("w8a8", src, out, python=python)
    assert not ran.exists() and [p.name for p in out.iterdir()] == ["keep.txt"]


def test_refusals_before_starting(tmp_path: Path) -> None:
    src = model_folder(tmp_path)
    python = stand_in_python(tmp_path, "exit 0\n")
    with pytest.raises(QuantizeError, match="gptq needs calibration data"):
        run_quantizer("gptq", src, tmp_path / "o1", python=python)
    with pytest.raises(QuantizeError, match="fp8 is data-free"):
        run_quantizer("fp8", src, tmp_path / "o2", calibration=CALIBRATION, python=python)
    with pytest.raises(QuantizeError, match="calibration file not found"):
        run_quantizer("awq", src, tmp_path / "o3", calibration=tmp_path / "nope.txt", python=python)
    with pytest.raises(QuantizeError, match="not a model folder"):
        run_quantizer("w8a8", tmp_path, tmp_path / "o4", python=python)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_a_failing_quantizer_names_its_reason_and_leaves_no_half_written_folder(tmp_path: Path) -> None:
    src = model_folder(tmp_path)
    out = tmp_path / "out"
    python = stand_in_python(tmp_path, (
        'mkdir -p "$OUT" && head -c 1000 /dev/zero > "$OUT/model.safetensors"\n'
        "echo 'quantize: saving the compressed checkpoint' >&2\n"
        "echo 'Traceback (most recent call last):' >&2\n"
        "echo 'error: RuntimeError: not enough memory to save model.safetensors' >&2\n"
        "exit 2\n"))
    lines: list[str] = []
    with pytest.raises(QuantizeError) as caught:
        run_quantizer("w8a8", src, out, progress=lines.append, python=python)
    assert str(caught.value) == "RuntimeError: not enough memory to save model.safetensors"
    assert lines[0] == "quantize: saving the compressed checkpoint"
    assert not out.exists()
    # An empty folder given by the caller stays, empty.
    out.mkdir()
    with pytest.raises(QuantizeError, match="not enough memory"):
        run_quantizer("w8a8", src, out, python=python)
    assert out.is_dir() and not any(out.iterdir())


def test_a_crash_without_a_message_and_a_timeout(tmp_path: Path) -> None:
    src = model_folder(tmp_path)
    crash = stand_in_python(tmp_path, 'mkdir -p "$OUT"; echo "loading" >&2; kill -9 $$\n')
    with pytest.raises(QuantizeError, match=r"exited with code -9: loading"):
        run_quantizer("w8a8", src, tmp_path / "a", python=crash)
    assert not (tmp_path / "a").exists()
    os.remove(crash)
    slow = stand_in_python(tmp_path, 'mkdir -p "$OUT"; exec sleep 60\n')
    with pytest.raises(QuantizeError, match="longer than 1 s"):
        run_quantizer("w8a8", src, tmp_path / "b", python=slow, timeout=1)
    assert not (tmp_path / "b").exists()


def test_a_result_line_that_is_not_json(tmp_path: Path) -> None:
    src = model_folder(tmp_path)
    python = stand_in_python(tmp_path, 'mkdir -p "$OUT"; touch "$OUT/config.json"; echo "done!"\n')
    with pytest.raises(QuantizeError, match="not the expected JSON"):
        run_quantizer("w8a8", src, tmp_path / "out", python=python)
    assert not (tmp_path / "out").exists()


def test_the_worker_refuses_in_one_line(tmp_path: Path) -> None:
    # The real worker's refusals happen before it imports torch, so any python shows them.
    import subprocess
    import sys

    src = model_folder(tmp_path, hidden_size=100, intermediate_size=300)
    run = subprocess.run([sys.executable, quantize_worker.__file__, "--method", "w4a16", "--src", str(src),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines()[-1] == (
        "error: no group size of 128/64/32 divides the model's dimensions (100, 300)")
    run = subprocess.run([sys.executable, quantize_worker.__file__, "--method", "int3"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert run.stderr.startswith("error: usage:")


# --- for real -----------------------------------------------------------------------------------

@pytest.mark.vllm
def test_w8a8_quantizes_the_real_smollm2(tmp_path: Path) -> None:
    python = quantizer_python()
    assert python is not None, f"no quantizer environment: run `make quant-env` or set {QUANT_VENV_ENV}"
    src = smol_model_dir()
    out = tmp_path / "smol-w8a8"
    lines: list[str] = []
    result = run_quantizer("w8a8", src, out, progress=lines.append, timeout=600)

    assert (result.method, result.scheme, result.calibration, result.out) == ("w8a8", "W8A8", None, out)
    assert result.recipe == [{"modifier": "QuantizationModifier", "scheme": "W8A8", "targets": ["Linear"],
                              "ignore": ["lm_head"]}]
    assert result.tools["llmcompressor"] == "0.14.0.1" and result.tools["compressed-tensors"]
    assert result.tools["torch"].startswith("2.13.0") and result.tools["transformers"]
    assert 0 < result.seconds < 600 and result.peak_rss_mb > 300
    assert result.parameters()["recipe"] == result.recipe
    assert any(line.startswith("quantize: loading") for line in lines)

    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "int-quantized"
    group = next(iter(quant["config_groups"].values()))
    assert group["weights"]["num_bits"] == 8 and group["weights"]["type"] == "int"
    assert group["input_activations"]["dynamic"] is True
    assert "lm_head" in quant["ignore"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    # int8 linear weights: the checkpoint is well under the bf16 one (160 MB against 260 MB).
    assert (out / "model.safetensors").stat().st_size < 0.7 * (src / "model.safetensors").stat().st_size
