"""Model versions on real SmolLM2: register the base, quantize it for real (W8A8 with llm-compressor),
serve the quantized version with a real CPU vLLM started as a Slurm job from `--model-version`, chat
through the gateway, evaluate base and quantized, gate and promote; a degraded version is refused.

One vLLM at a time (2 cores): the base server stops before the Slurm job starts.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from examlops.provenance import validate_bom
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.slurm import ExtraLauncher, SlurmCluster, extra_launcher, wait_for
from examlops_testsupport.vllm import (
    launcher_settings,
    serving_rss_mb,
    smol_block,
    smol_model_dir,
    start_vllm,
    write_pack,
)

pytestmark = pytest.mark.vllm
NAME = "smolv"


@pytest.fixture(scope="module")
def signer(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    keys = tmp_path_factory.mktemp("signing")
    assert stack.cli("models", "keygen", "--out", str(keys)).returncode == 0
    assert stack.cli("models", "trust", "add", str(keys / "signing.pub"), "--name", "release").returncode == 0
    return {"EXAMLOPS_SIGNING_KEY": str(keys / "signing.key")}


def exa(stack: Stack, env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return stack.cli(*args, env=env, timeout=timeout)


def ok_json(out: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert out.returncode == 0, out.stderr
    data: dict[str, object] = json.loads(out.stdout)
    return data


def tokens_per_s(base_url: str, model: str) -> float:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0, timeout=120)
    try:
        t0 = time.monotonic()
        resp = client.chat.completions.create(model=model, max_tokens=64, temperature=0,
                                              messages=[{"role": "user", "content": "Tell me about the sea."}])
        assert resp.usage is not None and resp.choices[0].message.content
        return resp.usage.completion_tokens / (time.monotonic() - t0)
    finally:
        client.close()


@pytest.fixture(scope="module")
def base(stack: Stack, signer: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """smolv@1 (the converted SmolLM2 folder) registered, served by a real vLLM, evaluated as the baseline."""
    mv = ok_json(exa(stack, signer, "--json", "models", "register", NAME, "--path", str(smol_model_dir()),
                     "--dataset", "HuggingFaceTB/smollm-corpus", "--dataset-revision", "3ba9d60"))
    assert mv["ref"] == f"{NAME}@1"
    port = free_port()
    proc = start_vllm(tmp_path_factory.mktemp("vllm-base"), port, smol_block())
    try:
        url = f"http://127.0.0.1:{port}"
        ok_json(exa(stack, signer, "--json", "serve", "llm", "start", f"{NAME}-base", "--engine", "vllm",
                    "--base-url", url, "--served-model-name", "smol", "--model-version", f"{NAME}@1"))
        result = ok_json(exa(stack, signer, "--json", "models", "eval", f"{NAME}@1", "--endpoint", f"{NAME}-base"))
        wait_until(lambda: exa(stack, signer, "gateway", "chat", f"{NAME}-base", "--message", "hi").returncode == 0,
                   15)
        speed = tokens_per_s(stack.gateway_url, f"{NAME}-base")
        print(f"\n[{NAME}@1] perplexity {result['perplexity']:.2f}, task score {result['task_score']:.3f}, "
              f"{speed:.1f} tok/s, vLLM RSS {serving_rss_mb(str(smol_model_dir())):.0f} MB")
        yield {**mv, "eval": result, "tok_s": speed}
    finally:
        proc.stop()
        exa(stack, signer, "serve", "llm", "stop", f"{NAME}-base", "--yes")


@pytest.fixture(scope="module")
def quantized(stack: Stack, signer: dict[str, str], base: dict[str, object],
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("quant") / "w8a8"
    t0 = time.monotonic()
    mv = ok_json(exa(stack, signer, "--json", "models", "quantize", NAME, "1", "--method", "w8a8", "--path", str(out)))
    print(f"\n[{NAME}@1-w8a8] quantized and registered in {time.monotonic() - t0:.1f} s")
    return mv


@pytest.mark.timeout(1200)
def test_the_quantized_version_carries_its_parent_and_recipe_in_a_valid_bom(
        stack: Stack, base: dict[str, object], quantized: dict[str, object]) -> None:
    assert quantized["ref"] == f"{NAME}@1-w8a8" and quantized["parent"] == f"{NAME}@1"
    assert quantized["quantization"] == "w8a8" and not quantized.get("degraded")
    text = stack.cli("models", "bom", f"{NAME}@1-w8a8").stdout
    validate_bom(text)
    subject = json.loads(text)["metadata"]["component"]
    ancestor = subject["pedigree"]["ancestors"][0]
    assert (ancestor["name"], ancestor["version"]) == (NAME, "1")
    assert ancestor["hashes"][0]["content"] == base["bom_sha256"]
    card = {p["name"]: p["value"] for p in subject["modelCard"]["properties"]}
    assert card["examlops:quantization.method"] == "w8a8"
    assert "QuantizationModifier" in card["examlops:quantization.parameters"]
    assert "compressed-tensors" in card["examlops:checkpoint.quantization_config"]
    tools = {t["name"] for t in json.loads(text)["metadata"]["tools"]["components"]}
    assert {"examlops", "llmcompressor", "torch"} <= tools


@pytest.fixture()
def slurm_launcher(stack: Stack, slurm: SlurmCluster, tmp_path: Path) -> Iterator[tuple[ExtraLauncher, Path]]:
    write_pack(tmp_path, f"{NAME}q")
    with extra_launcher(stack, tmp_path, "launcher-versions", {**slurm.env, **launcher_settings(tmp_path)}) as la:
        yield la, tmp_path
    slurm.cancel_all()


@pytest.mark.timeout(1500)
def test_serve_eval_gate_and_promote_the_quantized_version(
        stack: Stack, signer: dict[str, str], base: dict[str, object], quantized: dict[str, object],
        slurm_launcher: tuple[ExtraLauncher, Path]) -> None:
    launcher, root = slurm_launcher
    ep = f"{NAME}q"
    env = {**signer, "EXAMLOPS_USECASE_DIR": str(root / "packs")}
    started = launcher.cli(stack, "--json", "serve", "llm", "start", ep, "--launcher", "slurm", "--gpus", "1",
                           "--port", str(free_port()), "--walltime", "00:30:00", "--yes",
                           "--model-version", f"{NAME}@1-w8a8", env=env)
    assert started.returncode == 0, started.stderr
    record = json.loads(started.stdout)
    assert record["model_version"] == f"{NAME}@1-w8a8"
    assert record["engine_block"]["hf_model_id"] == quantized["path"]
    assert "quantization" not in record["engine_block"]
    wait_for(lambda: launcher.cli(stack, "serve", "llm", "health", ep).returncode == 0, 600, 2, f"{ep} READY")

    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    try:
        wait_until(lambda: any(m.id == ep for m in client.models.list()), 10)
        answer = client.chat.completions.create(model=ep, max_tokens=16,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content
    finally:
        client.close()
    speed = tokens_per_s(stack.gateway_url, ep)
    rss = serving_rss_mb(str(quantized["path"]))

    out = exa(stack, env, "--json", "models", "eval", f"{NAME}@1-w8a8", "--endpoint", ep)
    result = json.loads(out.stdout)
    assert out.returncode == (0 if result["passed"] else 1), out.stderr
    parent = base["eval"]
    print(f"\n[{NAME}@1-w8a8] perplexity {result['perplexity']:.2f} (parent {parent['perplexity']:.2f}), "  # type: ignore[index]
          f"task score {result['task_score']:.3f} (parent {parent['task_score']:.3f}), {speed:.1f} tok/s "  # type: ignore[index]
          f"(parent {base['tok_s']:.1f}), vLLM RSS {rss:.0f} MB; "
          f"gate: {'PASS' if result['passed'] else 'FAIL'} — {result['gate']}")

    # The base passed its (baseline) gate: it is promoted; the quantized one only if its gate passed.
    assert base["eval"]["passed"] is True  # type: ignore[index]
    first = exa(stack, env, "--json", "pipeline", "promote", f"{NAME}@1", "--alias", "Production")
    assert first.returncode == 0 and json.loads(first.stdout)["aliases"] == ["Production"], first.stderr
    promoted = exa(stack, env, "--json", "pipeline", "promote", f"{NAME}@1-w8a8", "--alias", "Production")
    if result["passed"]:
        assert promoted.returncode == 0, promoted.stderr
        assert json.loads(promoted.stdout)["aliases"] == ["Production"]
    else:
        assert promoted.returncode == 1 and "eval" in promoted.stderr

    # The same version under a floor it cannot meet: the gate refuses and so does promotion.
    pack = root / "strict" / "models"
    pack.mkdir(parents=True)
    (pack / f"{NAME}.yaml").write_text(json.dumps({
        "engine": {"engine": "vllm", "hf_model_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "bfloat16"},
        "eval_gate": {"min_task_score": 1.0}}))
    strict = exa(stack, {**env, "EXAMLOPS_USECASE_DIR": str(root / "strict")}, "--json", "models", "eval",
                 f"{NAME}@1-w8a8", "--endpoint", ep)
    assert strict.returncode == 1 and json.loads(strict.stdout)["passed"] is False
    refused = exa(stack, env, "pipeline", "promote", f"{NAME}@1-w8a8", "--alias", "Staging")
    assert refused.returncode == 1 and "eval" in refused.stderr
    assert launcher.cli(stack, "serve", "llm", "stop", ep, "--yes").returncode == 0


def test_a_degraded_version_is_recorded_and_never_served(
        stack: Stack, signer: dict[str, str], base: dict[str, object], tmp_path: Path) -> None:
    env = {**signer, "EXAMLOPS_QUANT_VENV": str(tmp_path / "no-quantizer")}
    mv = ok_json(exa(stack, env, "--json", "models", "quantize", NAME, "1", "--method", "fp8",
                     "--path", str(tmp_path / "fp8")))
    assert mv["ref"] == f"{NAME}@1-fp8" and mv["degraded"] and "quantizer" in str(mv["degraded_reason"])
    bom = json.loads(stack.cli("models", "bom", f"{NAME}@1-fp8").stdout)
    props = {p["name"]: p["value"] for p in bom["metadata"]["component"]["properties"]}
    assert props["examlops:degraded"] == "true"
    refused = exa(stack, env, "serve", "llm", "start", f"{NAME}-fp8", "--engine", "vllm",
                  "--base-url", "http://127.0.0.1:9", "--model-version", f"{NAME}@1-fp8")
    assert refused.returncode == 1 and "degraded" in refused.stderr and f"{NAME}@1-fp8" in refused.stderr
    promoted = exa(stack, env, "pipeline", "promote", f"{NAME}@1-fp8", "--alias", "Production",
                   "--force", "--reason", "try")
    assert promoted.returncode == 1 and "degraded" in promoted.stderr
