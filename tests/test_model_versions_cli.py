"""`exa models` versions as an operator runs them, against the real registry: keys, register, BOM,
verify, tampering (a changed byte, a changed BOM, an untrusted signer), promote, and serving a
version by its alias (the rendered argv loads the version's folder)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from examlops.provenance import validate_bom
from examlops.registry.v1 import registry_pb2 as reg
from examlops_testsupport.fixtures import Stack
from examlops_testsupport.models import tiny_model


@pytest.fixture(scope="module")
def keys(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("keys")
    made = stack.cli("--json", "models", "keygen", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert stack.cli("models", "trust", "add", str(out / "signing.pub"), "--name", "tests").returncode == 0
    return out


def cli(stack: Stack, keys: Path, *args: str) -> tuple[int, str, str]:
    out = stack.cli(*args, env={"EXAMLOPS_SIGNING_KEY": str(keys / "signing.key")})
    return out.returncode, out.stdout, out.stderr


def registered(stack: Stack, keys: Path, folder: Path, name: str, *extra: str) -> dict[str, object]:
    code, out, err = cli(stack, keys, "--json", "models", "register", name, "--path", str(folder), *extra)
    assert code == 0, err
    result: dict[str, object] = json.loads(out)
    return result


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(stack: Stack, keys: Path) -> None:
    assert stat.S_IMODE(os.stat(keys / "signing.key").st_mode) == 0o600
    assert (keys / "signing.key").read_text().startswith("-----BEGIN PRIVATE KEY-----")
    again = stack.cli("models", "keygen", "--out", str(keys))
    assert again.returncode == 1 and "never overwritten" in again.stderr
    listed = json.loads(stack.cli("--json", "models", "trust", "list").stdout)
    assert "tests" in {k["name"] for k in listed}


def test_register_writes_a_valid_signed_bom_with_every_file_digest(stack: Stack, keys: Path, tmp_path: Path) -> None:
    folder = tiny_model(tmp_path / "m")
    (tmp_path / "data.txt").write_text("some training text\n")
    mv = registered(stack, keys, folder, "tiny-reg", "--dataset", str(tmp_path / "data.txt"),
                    "--dataset-revision", "r1", "--project", "research")
    assert mv["ref"] == "tiny-reg@1" and mv["project"] == "research"
    assert {f["path"] for f in mv["files"]} == {"config.json", "tokenizer_config.json", "model.safetensors"}
    bom_text = stack.cli("models", "bom", "tiny-reg@1").stdout
    validate_bom(bom_text)
    bom = json.loads(bom_text)
    card = bom["metadata"]["component"]["modelCard"]
    assert card["modelParameters"]["modelArchitecture"] == "LlamaForCausalLM"
    props = {p["name"]: p["value"] for p in card["properties"]}
    assert props["examlops:parameters"] == "144" and props["examlops:dtype"] == "bfloat16"
    assert any(c["type"] == "data" and c["version"] == "r1" for c in bom["components"])
    # A second registration gets the next number; the secret key's path never shows.
    again = registered(stack, keys, folder, "tiny-reg")
    assert again["ref"] == "tiny-reg@2"
    assert str(keys / "signing.key") not in json.dumps(again)
    code, out, _ = cli(stack, keys, "models", "verify", "tiny-reg@1")
    assert code == 0 and "verifies" in out


def test_register_needs_a_signing_key_and_a_revision(stack: Stack, keys: Path, tmp_path: Path) -> None:
    folder = tiny_model(tmp_path / "m")
    unsigned = stack.cli("models", "register", "tiny-nokey", "--path", str(folder), env={"EXAMLOPS_SIGNING_KEY": ""})
    assert unsigned.returncode == 1 and "EXAMLOPS_SIGNING_KEY" in unsigned.stderr
    code, _, err = cli(stack, keys, "models", "register", "tiny-nokey", "--path", str(folder), "--dataset", "FData")
    assert code == 1 and "--dataset-revision" in err
    assert json.loads(stack.cli("--json", "models", "versions", "tiny-nokey").stdout) == []


def test_one_changed_byte_fails_verify_naming_the_file_and_blocks_promote_and_serving(
        stack: Stack, keys: Path, tmp_path: Path) -> None:
    folder = tiny_model(tmp_path / "m")
    registered(stack, keys, folder, "tiny-tamper")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    code, _, err = cli(stack, keys, "models", "verify", "tiny-tamper@1")
    assert code == 1 and "model.safetensors" in err and "changed" in err
    code, out, _ = cli(stack, keys, "--json", "models", "verify", "tiny-tamper@1")
    assert code == 1 and json.loads(out)["verified"] is False
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-tamper@1", "--alias", "Production",
                       "--force", "--reason", "try")
    assert code == 1 and "model.safetensors" in err
    code, _, err = cli(stack, keys, "serve", "llm", "start", "tiny-tamper-ep", "--model-version", "tiny-tamper@1",
                       "--engine", "vllm", "--base-url", "http://127.0.0.1:9")
    assert code == 1 and "refusing to serve" in err and "model.safetensors" in err
    weights.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))  # restored: verifies again
    assert cli(stack, keys, "models", "verify", "tiny-tamper@1")[0] == 0
    (folder / "extra.bin").write_bytes(b"x")
    code, _, err = cli(stack, keys, "models", "verify", "tiny-tamper@1")
    assert code == 1 and "extra.bin" in err and "not listed" in err


def test_a_bom_changed_in_the_store_no_longer_verifies_or_promotes(stack: Stack, keys: Path, tmp_path: Path) -> None:
    folder = tiny_model(tmp_path / "m")
    registered(stack, keys, folder, "tiny-bom")
    r = stack_redis(stack)
    field = next(k for k in r.hkeys("{exa:reg}:model_versions") if "tiny-bom" in k)
    record = json.loads(r.hget("{exa:reg}:model_versions", field))
    record["bom_json"] = record["bom_json"].replace('"dtype"', '"Dtype"', 1) if '"dtype"' in record["bom_json"] \
        else record["bom_json"].replace("bfloat16", "float32bf", 1)
    r.hset("{exa:reg}:model_versions", field, json.dumps(record))
    code, _, err = cli(stack, keys, "models", "verify", "tiny-bom@1")
    assert code == 1 and ("does not verify" in err or "SHA-256" in err)
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-bom@1", "--alias", "Production",
                       "--force", "--reason", "try")
    assert code == 1 and "not promoted" in err


def test_a_version_signed_by_an_untrusted_key_is_refused(stack: Stack, keys: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    assert stack.cli("models", "keygen", "--out", str(other)).returncode == 0
    out = stack.cli("models", "register", "tiny-untrusted", "--path", str(tiny_model(tmp_path / "m")),
                    env={"EXAMLOPS_SIGNING_KEY": str(other / "signing.key")})
    assert out.returncode == 1 and "untrusted" in out.stderr
    assert json.loads(stack.cli("--json", "models", "versions", "tiny-untrusted").stdout) == []


def test_promote_needs_a_passing_eval_and_serving_resolves_the_alias(stack: Stack, keys: Path, tmp_path: Path) -> None:
    folder = tiny_model(tmp_path / "m")
    mv = registered(stack, keys, folder, "tiny-promo")
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-promo@1", "--alias", "Production")
    assert code == 1 and "eval" in err
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-promo@1", "--alias", "Production", "--force")
    assert code == 1 and "--reason" in err
    record_eval(stack, "tiny-promo", "1", str(mv["bom_sha256"]), passed=True)
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-promo@1", "--alias", "Production")
    assert code == 0, err
    listed = json.loads(stack.cli("--json", "models", "versions", "tiny-promo").stdout)
    assert listed[0]["aliases"] == ["Production"]
    # Serving by alias: the plan loads the version's folder.
    pack = tmp_path / "pack" / "models"
    pack.mkdir(parents=True)
    (pack / "tiny-ep.yaml").write_text(json.dumps({"engine": {
        "engine": "vllm", "hf_model_id": "org/tiny", "served_model_name": "tiny-ep", "dtype": "bfloat16",
        "quantization": "awq"}}))
    plan = stack.cli("--json", "serve", "llm", "start", "tiny-ep", "--model-version", "tiny-promo@Production",
                     "--launcher", "slurm", "--gpus", "1", "--dry-run",
                     env={"EXAMLOPS_USECASE_DIR": str(tmp_path / "pack")})
    assert plan.returncode == 0, plan.stderr
    argv = json.loads(plan.stdout)["argv"]
    assert str(folder.resolve()) in argv and "--quantization" not in argv
    # On KServe the alias resolves too: the version comes from the cluster's model store.
    (pack / "tiny-promo.yaml").write_text((pack / "tiny-ep.yaml").read_text())
    out = stack.cli("--json", "serve", "manifest", "tiny-promo", "--alias", "Production", "--gpus", "1",
                    env={"EXAMLOPS_USECASE_DIR": str(tmp_path / "pack")})
    assert out.returncode == 0, out.stderr
    manifest = yaml.safe_load(json.loads(out.stdout)["manifest"])
    assert manifest["spec"]["model"]["uri"] == "pvc://examlops-models/tiny-promo/1"
    assert manifest["metadata"]["annotations"] == {"examlops.io/model-version": "tiny-promo@1"}
    assert manifest["spec"]["template"]["containers"][0]["command"][2] == "/mnt/models"
    unknown = stack.cli("serve", "manifest", "tiny-promo", "--alias", "Nowhere",
                        env={"EXAMLOPS_USECASE_DIR": str(tmp_path / "pack")})
    assert unknown.returncode == 1 and "Nowhere" in unknown.stderr
    # A failing eval after the promotion blocks the next one (force with a reason is audited).
    record_eval(stack, "tiny-promo", "1", str(mv["bom_sha256"]), passed=False)
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-promo@1", "--alias", "Staging")
    assert code == 1 and "eval" in err
    code, _, err = cli(stack, keys, "pipeline", "promote", "tiny-promo@1", "--alias", "Staging",
                       "--force", "--reason", "hotfix approved by the release board")
    assert code == 0, err
    events = json.loads(stack.cli("--json", "audit", "list", "--target", "model:tiny-promo@1").stdout)
    assert "model.promote.force" in {e["action"] for e in events}


def stack_redis(stack: Stack) -> Any:
    import redis

    return redis.Redis(port=stack.ports.redis, decode_responses=True)


def record_eval(stack: Stack, name: str, version: str, bom_sha256: str, passed: bool) -> None:
    stack.registry().RecordEval(reg.RecordEvalRequest(
        name=name, version=version, actor="tests", result=reg.EvalResult(
            perplexity=30.0, task_score=0.5, task_count=10, suite="tests", target="tests", passed=passed,
            gate="tests", reason="" if passed else "tests: failed", bom_sha256=bom_sha256)), timeout=10)


def test_methods_say_what_this_host_can_run_and_serve(stack: Stack) -> None:
    rows = {r["method"]: r for r in json.loads(stack.cli("--json", "models", "methods").stdout)}
    assert set(rows) == {"w8a8", "w4a16", "fp8", "gptq", "awq"}
    assert rows["gptq"]["needs_calibration"] and not rows["w8a8"]["needs_calibration"]
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    if rows["fp8"]["quantizer_here"]:  # without the quantizer environment every method is degraded here
        assert rows["fp8"]["servable_here"] is amx and (amx or "AMX" in rows["fp8"]["reason"])

