"""Model versions on a real registry and Redis: signed BOMs, trusted keys, evals, aliases, judge calibrations.

Each version is built as `exa models register` builds it: a model folder is digested, its CycloneDX
1.6 ML-BOM is built and signed with an Ed25519 key, and the registry checks all of it. Every refusal
is checked to leave nothing behind: no version, no audit event.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from examlops.provenance import (
    key_id,
    public_pem,
    sign,
)
from examlops.registry.v1 import registry_pb2 as reg
from examlops.registry.v1 import registry_pb2_grpc as reg_grpc
from examlops_testsupport.fixtures import TEST_OPERATOR, RedisServer, Stack
from examlops_testsupport.models import Signer, refusal, tiny_model, unique, version

VERSIONS = "{exa:reg}:model_versions"


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory, stack: Stack) -> Signer:
    s = Signer(tmp_path_factory.mktemp("keys") / "trusted")
    stack.registry().AddTrustedKey(reg.AddTrustedKeyRequest(
        key=reg.TrustedKey(key_id=s.key_id, public_key_pem=s.pem, name="tests-ci")), timeout=5)
    return s


def register(stack: Stack, mv: reg.ModelVersion) -> reg.ModelVersion:
    out: reg.ModelVersion = stack.registry().RegisterModelVersion(
        reg.RegisterModelVersionRequest(version=mv, actor="tests"), timeout=10)
    return out


def get(stack: Stack, name: str, v: str) -> reg.ModelVersion:
    out: reg.ModelVersion = stack.registry().GetModelVersion(reg.GetModelVersionRequest(name=name, version=v),
                                                             timeout=5)
    return out


def listed(stack: Stack, name: str = "") -> list[str]:
    found = stack.registry().ListModelVersions(reg.ListModelVersionsRequest(name=name), timeout=5).versions
    return [f"{v.name}@{v.version}" for v in found]


def events(stack: Stack, target: str, action: str = "") -> list[reg.AuditEvent]:
    return list(stack.registry().ListAuditEvents(reg.ListAuditEventsRequest(
        target=target, action=action, limit=10_000), timeout=5).events)


def evaluate(stack: Stack, mv: reg.ModelVersion, passed: bool, bom_sha256: str | None = None) -> reg.ModelVersion:
    result = reg.EvalResult(perplexity=12.5, task_score=0.9 if passed else 0.2, task_count=10,
                            suite="examlops-eval-v1:abc", target="inproc", passed=passed, gate="task_score >= 0.5",
                            reason="" if passed else "task_score 0.2 < 0.5",
                            bom_sha256=mv.bom_sha256 if bom_sha256 is None else bom_sha256)
    out: reg.ModelVersion = stack.registry().RecordEval(reg.RecordEvalRequest(
        name=mv.name, version=mv.version, result=result, actor="tests"), timeout=5)
    return out


def promote(stack: Stack, mv: reg.ModelVersion, alias: str, force: bool = False,
            reason: str = "") -> reg.ModelVersion:
    out: reg.ModelVersion = stack.registry().Promote(reg.PromoteRequest(
        name=mv.name, version=mv.version, alias=alias, force=force, reason=reason, actor="tests"), timeout=5)
    return out


def test_register_get_and_list(stack: Stack, signer: Signer, tmp_path: Path) -> None:
    name = unique("smol")
    base = version(name, "1", tiny_model(tmp_path / "base", "base"), signer, project="acme")
    mv = register(stack, base)
    assert (mv.created_by, mv.key_id, mv.project) == (TEST_OPERATOR, signer.key_id, "acme")
    assert mv.bom_sha256 == hashlib.sha256(base.bom_json.encode()).hexdigest() and mv.created_at_ms > 0
    assert mv.bom_json == base.bom_json and not mv.parent and not mv.degraded and not mv.evals
    assert sorted(f.path for f in mv.files) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert get(stack, name, "1") == mv

    quant = version(name, "1-w8a8", tiny_model(tmp_path / "q", "quantized"), signer, parent=mv,
                    quantization="w8a8")
    derived = register(stack, quant)
    assert (derived.parent, derived.quantization) == (f"{name}@1", "w8a8")
    assert listed(stack, name) == [f"{name}@1", f"{name}@1-w8a8"]
    everything = listed(stack)
    assert everything.index(f"{name}@1") < everything.index(f"{name}@1-w8a8")
    assert everything == sorted(everything, key=lambda ref: ref.partition("@")[0])

    [event] = events(stack, f"model:{name}@1", "model.register")
    assert (event.actor, event.before_json) == (TEST_OPERATOR, "") and signer.key_id in event.after_json
    resources = stack.registry().ListProjectResources(
        reg.ListProjectResourcesRequest(project="acme", kind="model_version"), timeout=5).resources
    assert f"{name}@1" in {r.name for r in resources}

    code, reason, field, message = refusal(lambda: get(stack, name, "7"))
    assert (code, reason, field) == (grpc.StatusCode.NOT_FOUND, "version_not_found", "version")
    assert "1-w8a8" in message
    code, reason, _, _ = refusal(lambda: get(stack, unique("nobody"), "1"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "model_not_found")


def test_trusted_keys_are_checked_listed_and_removed(stack: Stack, tmp_path: Path) -> None:
    s = Signer(tmp_path / "k")
    r = stack.registry()
    code, reason, field, _ = refusal(lambda: r.AddTrustedKey(reg.AddTrustedKeyRequest(
        key=reg.TrustedKey(key_id="0" * 16, public_key_pem=s.pem)), timeout=5))
    assert (code, reason, field) == (grpc.StatusCode.INVALID_ARGUMENT, "key_id_mismatch", "key_id")
    garbled = public_pem(Ed25519PrivateKey.generate().public_key()).replace("PUBLIC", "PUBLIK")
    p256 = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    for pem in (garbled, p256, ""):
        code, reason, field, _ = refusal(lambda pem=pem: r.AddTrustedKey(reg.AddTrustedKeyRequest(  # type: ignore[misc]
            key=reg.TrustedKey(public_key_pem=pem)), timeout=5))
        assert (code, reason, field) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_key", "public_key_pem")
    assert not events(stack, f"signing_key:{s.key_id}")

    added = r.AddTrustedKey(reg.AddTrustedKeyRequest(key=reg.TrustedKey(public_key_pem=s.pem, name="ci")), timeout=5)
    assert (added.key_id, added.added_by, added.name) == (s.key_id, TEST_OPERATOR, "ci") and added.added_at_ms > 0
    assert added in r.ListTrustedKeys(reg.ListTrustedKeysRequest(), timeout=5).keys
    removed = r.RemoveTrustedKey(reg.RemoveTrustedKeyRequest(key_id=s.key_id), timeout=5)
    assert removed == added
    assert s.key_id not in {k.key_id for k in r.ListTrustedKeys(reg.ListTrustedKeysRequest(), timeout=5).keys}
    code, reason, _, _ = refusal(lambda: r.RemoveTrustedKey(reg.RemoveTrustedKeyRequest(key_id=s.key_id), timeout=5))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "key_not_found")
    assert [e.action for e in events(stack, f"signing_key:{s.key_id}")] == ["model.trust.remove", "model.trust.add"]


def _tampered_bom(mv: reg.ModelVersion) -> reg.ModelVersion:
    """One character of a file's digest changed in the BOM and in the files listed: the files are swapped."""
    out = reg.ModelVersion()
    out.CopyFrom(mv)
    f = next(f for f in out.files if f.path == "model.safetensors")
    swapped = ("1" if f.sha256[0] != "1" else "2") + f.sha256[1:]
    assert out.bom_json.count(f.sha256) == 1
    out.bom_json = out.bom_json.replace(f.sha256, swapped)
    f.sha256 = swapped
    return out


def _cases(name: str, folder: Path, signer: Signer, stranger: Signer) -> dict[str, tuple[reg.ModelVersion, str]]:
    """Refused registrations of `name`, each with the version it tried and the reason expected."""
    good = version(name, "1", folder, signer)
    unsigned = reg.ModelVersion()
    unsigned.CopyFrom(version(name, "2", folder, signer))
    unsigned.signature = ""
    replayed = version(name, "1", folder, signer)  # a BOM signed for NAME@1 ...
    replayed.version = "3"                         # ... offered as NAME@3
    other_files = version(name, "4", folder, signer)
    other_files.files[0].size += 1
    missing_file = version(name, "5", folder, signer)
    del missing_file.files[-1]
    invalid = version(name, "6", folder, signer)
    invalid.bom_json = json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.6", "components": "many"})
    invalid.signature = sign(signer.key, invalid.bom_json)
    orphan = version(name, "7", folder, signer, parent=reg.ModelVersion(name=name, version="99"))
    claimed_parent = version(name, "8", folder, signer)
    claimed_parent.parent = f"{name}@1"
    bad_name = version(name, "9", folder, signer)
    bad_name.version = "-9"
    return {
        "unsigned": (unsigned, "unsigned"),
        "untrusted": (version(name, "10", folder, stranger), "untrusted_key"),
        "bad signature": (_tampered_bom(version(name, "11", folder, signer)), "bad_signature"),
        "replayed BOM": (replayed, "bom_mismatch"),
        "files differ": (other_files, "files_mismatch"),
        "file missing": (missing_file, "files_mismatch"),
        "invalid CycloneDX": (invalid, "bom_invalid"),
        "not JSON": (reg.ModelVersion(name=name, version="12", bom_json="{", signature=sign(signer.key, "{"),
                                      key_id=signer.key_id), "bom_invalid"),
        "unknown parent": (orphan, "parent_unknown"),
        "parent not in the BOM": (claimed_parent, "bom_mismatch"),
        "invalid version": (bad_name, "invalid_model_version"),
        "duplicate version": (good, "version_exists"),
    }


CODES = {"version_exists": grpc.StatusCode.ALREADY_EXISTS, "bom_invalid": grpc.StatusCode.INVALID_ARGUMENT,
         "invalid_model_version": grpc.StatusCode.INVALID_ARGUMENT}


def test_every_refused_registration_leaves_nothing_written(stack: Stack, signer: Signer, tmp_path: Path) -> None:
    name = unique("refused")
    folder = tiny_model(tmp_path / "m", "m")
    stranger = Signer(tmp_path / "stranger")
    first = register(stack, version(name, "1", folder, signer))
    audit_before = len(events(stack, "", "model.register"))
    messages = {}
    for case, (mv, want) in _cases(name, folder, signer, stranger).items():
        code, reason, _field, message = refusal(lambda mv=mv: register(stack, mv))  # type: ignore[misc]
        assert (code, reason) == (CODES.get(want, grpc.StatusCode.FAILED_PRECONDITION), want), (case, message)
        messages[case] = message
        if want != "version_exists":
            assert not events(stack, f"model:{name}@{mv.version}"), case
    assert listed(stack, name) == [f"{name}@1"] and get(stack, name, "1") == first
    assert len(events(stack, "", "model.register")) == audit_before
    assert f"the BOM describes {name}@1, not {name}@3" in messages["replayed BOM"]
    assert f"signed by untrusted key {stranger.key_id}" in messages["untrusted"]
    assert "exa models trust add PUBFILE" in messages["untrusted"]
    assert "does not verify" in messages["bad signature"]
    assert "config.json" in messages["files differ"] and "tokenizer_config.json" in messages["file missing"]
    assert "unsigned" in messages["unsigned"] and f"{name}@99" in messages["unknown parent"]


def test_promotion_needs_a_passing_eval_unless_forced_with_a_reason(stack: Stack, signer: Signer,
                                                                    tmp_path: Path) -> None:
    mv = register(stack, version(unique("gate"), "1", tiny_model(tmp_path / "m", "gate"), signer))
    code, reason, _, message = refusal(lambda: promote(stack, mv, "Production"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "eval_missing"), message
    evaluated = evaluate(stack, mv, passed=True)
    assert evaluated.evals[-1].actor == TEST_OPERATOR and evaluated.evals[-1].time_ms > 0
    assert promote(stack, mv, "Production").aliases == ["Production"]
    evaluate(stack, mv, passed=False)
    code, reason, _, message = refusal(lambda: promote(stack, mv, "Staging"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "eval_failed") and "0.2 < 0.5" in message
    code, reason, field, _ = refusal(lambda: promote(stack, mv, "Staging", force=True, reason="  "))
    assert (code, reason, field) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_promotion", "reason")
    forced = promote(stack, mv, "Staging", force=True, reason="hotfix approved by on-call")
    assert forced.aliases == ["Production", "Staging"] and len(forced.evals) == 2
    target = f"model:{mv.name}@1"
    assert [e.action for e in events(stack, target)] == [
        "model.promote.force", "model.eval", "model.promote", "model.eval", "model.register"]
    [event] = events(stack, target, "model.promote.force")
    assert json.loads(event.after_json)["reason"] == "hotfix approved by on-call" and event.actor == TEST_OPERATOR


def test_an_alias_moves_between_versions(stack: Stack, signer: Signer, tmp_path: Path) -> None:
    name = unique("alias")
    one = register(stack, version(name, "1", tiny_model(tmp_path / "1", "one"), signer))
    two = register(stack, version(name, "2", tiny_model(tmp_path / "2", "two"), signer))
    for mv in (one, two):
        evaluate(stack, mv, passed=True)
    promote(stack, one, "Production")
    assert get(stack, name, "Production").version == "1"
    assert promote(stack, two, "Production").aliases == ["Production"]
    assert get(stack, name, "Production").version == "2"
    assert list(get(stack, name, "1").aliases) == []
    [moved] = events(stack, f"model:{name}@2", "model.promote")
    assert json.loads(moved.before_json) == {"alias": "Production", "version": "1"}
    code, reason, _, _ = refusal(lambda: promote(stack, one, "1bad"))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_promotion")
    three = version(name, "Production", tiny_model(tmp_path / "3", "three"), signer)
    code, reason, _, _ = refusal(lambda: register(stack, three))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "version_is_alias")
    code, reason, _, message = refusal(lambda: get(stack, name, "Staging"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "version_not_found") and "Production" in message


def test_promotion_rechecks_the_signature_against_the_keys_trusted_now(
        stack: Stack, signer: Signer, redis_server: RedisServer, tmp_path: Path) -> None:
    revoked = Signer(tmp_path / "revoked")
    r = stack.registry()
    r.AddTrustedKey(reg.AddTrustedKeyRequest(key=reg.TrustedKey(public_key_pem=revoked.pem)), timeout=5)
    mv = register(stack, version(unique("revoked"), "1", tiny_model(tmp_path / "m", "r"), revoked))
    evaluate(stack, mv, passed=True)
    r.RemoveTrustedKey(reg.RemoveTrustedKeyRequest(key_id=revoked.key_id), timeout=5)
    code, reason, _, message = refusal(lambda: promote(stack, mv, "Production"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "untrusted_key") and revoked.key_id in message
    code, reason, _, _ = refusal(lambda: promote(stack, mv, "Production", force=True, reason="urgent"))
    assert reason == "untrusted_key"
    assert not get(stack, mv.name, "1").aliases and not events(stack, f"model:{mv.name}@1", "model.promote")

    # A record changed in Redis behind the registry's back: one character of its BOM.
    other = register(stack, version(unique("tampered"), "1", tiny_model(tmp_path / "t", "t"), signer))
    evaluate(stack, other, passed=True)
    client = redis_server.client()
    ref = f"{other.name}@1"
    stored = json.loads(str(client.hget(VERSIONS, ref)))
    stored["bom_json"] = stored["bom_json"].replace('"version":"1.0"', '"version":"1.1"')
    client.hset(VERSIONS, ref, json.dumps(stored))
    code, reason, _, _ = refusal(lambda: promote(stack, other, "Production"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "bad_signature")
    stored["bom_json"] = other.bom_json
    stored["files"][0]["size"] = "1"
    client.hset(VERSIONS, ref, json.dumps(stored))
    code, reason, _, _ = refusal(lambda: promote(stack, other, "Production"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "files_mismatch")


def test_a_degraded_version_is_never_promoted(stack: Stack, signer: Signer, tmp_path: Path) -> None:
    name = unique("degraded")
    base = register(stack, version(name, "1", tiny_model(tmp_path / "m", "d"), signer))
    why = "no GPU: the quantization was recorded, not run"
    lying = version(name, "1-w4a16", None, signer, parent=base, quantization="w4a16", degraded_reason=why)
    lying.degraded, lying.degraded_reason = False, ""
    code, reason, _, _ = refusal(lambda: register(stack, lying))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "bom_mismatch")
    mv = register(stack, version(name, "1-w4a16", None, signer, parent=base, quantization="w4a16",
                                 degraded_reason=why))
    assert (mv.degraded, mv.degraded_reason, mv.parent, list(mv.files)) == (True, why, f"{name}@1", [])
    evaluate(stack, mv, passed=True)
    for force in (False, True):
        code, reason, _, message = refusal(lambda force=force: promote(  # type: ignore[misc]
            stack, mv, "Production", force=force, reason="try anyway"))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "degraded")
        assert f"{name}@1-w4a16 is degraded ({why}): it was recorded, not produced, and cannot be served" == message
    assert not get(stack, name, "1-w4a16").aliases


def test_an_eval_of_other_files_is_refused(stack: Stack, signer: Signer, tmp_path: Path) -> None:
    mv = register(stack, version(unique("eval"), "1", tiny_model(tmp_path / "m", "e"), signer))
    code, reason, field, message = refusal(lambda: evaluate(stack, mv, passed=True, bom_sha256="ab" * 32))
    assert (code, reason, field) == (grpc.StatusCode.FAILED_PRECONDITION, "eval_mismatch", "result.bom_sha256")
    assert "other files" in message
    code, reason, _, _ = refusal(lambda: stack.registry().RecordEval(reg.RecordEvalRequest(
        name=mv.name, version="2", result=reg.EvalResult(bom_sha256=mv.bom_sha256)), timeout=5))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "version_not_found")
    assert not get(stack, mv.name, "1").evals and not events(stack, f"model:{mv.name}@1", "model.eval")


def test_judge_calibration_round_trip(stack: Stack) -> None:
    r = stack.registry()
    route = unique("judge")
    code, reason, _, message = refusal(lambda: r.GetJudgeCalibration(reg.GetJudgeCalibrationRequest(route=route),
                                                                     timeout=5))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "calibration_not_found")
    assert f"exa serve challenger calibrate --judge-model {route} --set FILE" in message
    cal = reg.JudgeCalibration(route=route, agreement=0.9, threshold=0.8, samples=40, set_sha256="cd" * 32,
                               passed=True, endpoint_fingerprint="ef" * 32, actor="mallory", time_ms=1)
    code, reason, field, _ = refusal(lambda: r.RecordJudgeCalibration(reg.RecordJudgeCalibrationRequest(
        calibration=reg.JudgeCalibration(route=route, agreement=0.5, threshold=0.8, samples=4, set_sha256="x",
                                         passed=True)), timeout=5))
    assert (code, reason, field) == (grpc.StatusCode.INVALID_ARGUMENT, "invalid_calibration", "passed")
    recorded = r.RecordJudgeCalibration(reg.RecordJudgeCalibrationRequest(calibration=cal, actor="tests"), timeout=5)
    assert recorded.actor == TEST_OPERATOR and recorded.time_ms > 1
    assert r.GetJudgeCalibration(reg.GetJudgeCalibrationRequest(route=route), timeout=5) == recorded
    [event] = events(stack, f"judge:{route}")
    assert (event.action, event.actor, event.before_json) == ("judge.calibrate", TEST_OPERATOR, "")


def test_services_read_model_versions_but_only_operators_change_them(stack: Stack, signer: Signer) -> None:
    for service in ("gateway", "launcher"):
        with stack.channel("registry", stack.tokens.tokens[service]) as ch:
            r = reg_grpc.RegistryStub(ch)
            assert signer.key_id in {k.key_id for k in r.ListTrustedKeys(reg.ListTrustedKeysRequest(), timeout=5).keys}
            r.ListModelVersions(reg.ListModelVersionsRequest(), timeout=5)
            stranger = Ed25519PrivateKey.generate().public_key()
            code, _, _, _ = refusal(lambda r=r, k=stranger: r.AddTrustedKey(  # type: ignore[misc]
                reg.AddTrustedKeyRequest(key=reg.TrustedKey(public_key_pem=public_pem(k))), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert key_id(stranger) not in {
                k.key_id for k in stack.registry().ListTrustedKeys(reg.ListTrustedKeysRequest(), timeout=5).keys}
