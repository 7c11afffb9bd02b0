"""`exa serve challenger calibrate` and `judge` against the real services (issue 15).

The judge is a registered endpoint whose server is the recording backend: it answers the verdicts a
test scripts (`RecordingServer.answers`, one per call, in order) and shows the body each call carried.
The gateway holds its answers to the verdict schema: a scripted answer that is not the schema's JSON
is retried once (two scripted answers used) and then reaches the CLI as no verdict.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from examlops.registry.v1 import registry_pb2 as reg
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, free_port, wait_until
from examlops_testsupport.recorder import RecordingServer

SET = Path(__file__).resolve().parents[1] / "evals" / "judge" / "calibration-v1.jsonl"
LABELS = [json.loads(line)["label"] for line in SET.read_text().splitlines() if line.strip()]
NOT_JSON = "PASS, clearly"  # a judge ignoring the schema


def verdict(label: str, score: float | None = None) -> str:
    return json.dumps({"verdict": label, "score": score if score is not None else (0.9 if label == "pass" else 0.1)})


def flipped(label: str) -> str:
    return "fail" if label == "pass" else "pass"


@pytest.fixture(scope="module")
def engine() -> Iterator[RecordingServer]:
    server = RecordingServer()
    yield server
    server.close()


def register_judge(stack: Stack, engine: RecordingServer, route: str, served: str = "judge-a") -> reg.Endpoint:
    """Register `route` on the recording backend and wait until the gateway routes it."""
    ep = stack.register(route, engine="vllm-server", base_url=engine.url, served_model_name=served)
    engine.answers.clear()

    def routed() -> bool:
        resp = httpx.post(stack.gateway_url + "/v1/chat/completions", timeout=10,
                          headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"},
                          json={"model": route, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        return resp.status_code == 200

    wait_until(routed, 10, what=f"the gateway routing {route}")
    return ep


def recorded(stack: Stack, route: str) -> reg.JudgeCalibration | None:
    try:
        cal: reg.JudgeCalibration = stack.registry().GetJudgeCalibration(
            reg.GetJudgeCalibrationRequest(route=route), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        return None
    return cal if cal.route else None


def fingerprint(stack: Stack, route: str) -> str:
    ep = stack.registry().GetEndpoint(reg.GetEndpointRequest(name=route), timeout=10)
    return hashlib.sha256(json.dumps([ep.served_model_name, ep.engine_block_json, ep.created_at_ms],
                                     separators=(",", ":")).encode()).hexdigest()


def calibrate(stack: Stack, route: str, *extra: str, set_file: Path = SET) -> tuple[int, dict[str, object], str]:
    out = stack.cli("--json", "serve", "challenger", "calibrate", "--judge-model", route, "--set", str(set_file),
                    *extra)
    return out.returncode, json.loads(out.stdout) if out.stdout.strip() else {}, out.stderr


def judge(stack: Stack, route: str, *args: str) -> tuple[int, str, str]:
    out = stack.cli("serve", "challenger", "judge", "--judge-model", route, *args)
    return out.returncode, out.stdout, out.stderr


QA = ("--question", "What is the capital of Italy?", "--answer", "Rome", "--reference", "Rome")


def test_judge_before_any_calibration_refuses_naming_the_calibrate_command(stack: Stack,
                                                                           engine: RecordingServer) -> None:
    register_judge(stack, engine, "cj-fresh")
    calls = len(engine.bodies)
    code, _out, err = judge(stack, "cj-fresh", *QA)
    assert code == 1
    assert "not calibrated" in err and "exa serve challenger calibrate --judge-model cj-fresh --set FILE" in err
    assert len(engine.bodies) == calls  # the judge was never asked

    code, _out, err = judge(stack, "cj-nobody", *QA)
    assert code == 1 and "no endpoint named 'cj-nobody'" in err


def test_an_agreeing_calibration_passes_is_recorded_and_the_judge_then_works(stack: Stack,
                                                                              engine: RecordingServer) -> None:
    register_judge(stack, engine, "cj-good")
    calls = len(engine.bodies)
    engine.answers[:] = [verdict(label) for label in LABELS]
    code, report, err = calibrate(stack, "cj-good")
    assert code == 0, err
    assert len(engine.bodies) == calls + len(LABELS) and not engine.answers

    cal = recorded(stack, "cj-good")
    assert cal is not None and cal.passed and cal.agreement == 1.0 and cal.threshold == 0.8
    assert cal.samples == 20 and cal.set_sha256 == hashlib.sha256(SET.read_bytes()).hexdigest()
    assert cal.endpoint_fingerprint == fingerprint(stack, "cj-good")
    assert report["calibration"]["passed"] is True and report["agreed"] == 20  # type: ignore[index]
    assert report["confusion"] == {"fail->fail": 10, "pass->pass": 10} and report["disagreements"] == []

    sent = engine.bodies[calls]  # what the judge route's server got for the set's first item
    assert sent["temperature"] == 0 and sent["max_tokens"] <= 64 and sent["model"] == "judge-a"
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"]["properties"]["verdict"]["enum"] == ["pass", "fail"]
    user = sent["messages"][-1]["content"]
    assert "What is the capital of France?" in user and "Reference answer: Paris" in user

    engine.answers[:] = [verdict("fail", 0.05)]
    code, out, err = judge(stack, "cj-good", "--question", "What is 2 + 2?", "--answer", "5")
    assert code == 0, err
    assert out.split() == ["fail", "score", "0.05"]
    assert "Answer to grade: 5" in engine.bodies[-1]["messages"][-1]["content"]

    items = [{"id": "a", "question": "Capital of Spain?", "answer": "Madrid"},
             {"question": "Capital of Peru?", "answer": "Quito", "reference": "Lima", "label": "fail"}]
    batch = Path(stack.workdir) / "cj-batch.jsonl"
    batch.write_text("".join(json.dumps(i) + "\n" for i in items))
    engine.answers[:] = [verdict("pass", 0.97), verdict("fail", 0.02)]
    out2 = stack.cli("--json", "serve", "challenger", "judge", "--judge-model", "cj-good", "--set", str(batch))
    assert out2.returncode == 0, out2.stderr
    results = json.loads(out2.stdout)["results"]
    assert [(r["line"], r["verdict"], r["score"]) for r in results] == [(1, "pass", 0.97), (2, "fail", 0.02)]

    engine.answers[:] = [NOT_JSON, NOT_JSON]  # the first attempt and the gateway's retry
    code, out, err = judge(stack, "cj-good", *QA)
    assert code == 1 and "(no verdict" in out and "no verdict on 1 of 1" in err


def test_a_disagreeing_calibration_is_recorded_as_failed_and_the_judge_refuses(stack: Stack,
                                                                                engine: RecordingServer) -> None:
    register_judge(stack, engine, "cj-bad")
    answers: list[str] = []
    for i, label in enumerate(LABELS):  # 6 wrong verdicts, 2 no verdict: 12 of 20 agree
        answers += [NOT_JSON, NOT_JSON] if i in (0, 1) else [verdict(flipped(label) if i < 8 else label)]
    engine.answers[:] = answers
    code, report, err = calibrate(stack, "cj-bad")
    assert code == 1, err
    assert not engine.answers
    cal = recorded(stack, "cj-bad")
    assert cal is not None and not cal.passed and cal.agreement == pytest.approx(0.6) and cal.samples == 20
    assert report["calibration"]["passed"] is False  # type: ignore[index]
    assert report["confusion"] == {"fail->fail": 6, "fail->none": 1, "fail->pass": 3,  # LABELS alternate pass, fail
                                   "pass->fail": 3, "pass->none": 1, "pass->pass": 6}
    assert [d["line"] for d in report["disagreements"]] == list(range(1, 9))  # type: ignore[index,union-attr]

    human = stack.cli("serve", "challenger", "calibrate", "--judge-model", "cj-bad", "--set", str(SET),
                      "--threshold", "0.9")
    assert human.returncode == 1  # no scripted answers left: every verdict is "recorded", not JSON
    assert "failed" in human.stdout and "0 / 0 / 10" in human.stdout

    calls = len(engine.bodies)
    code, _out, err = judge(stack, "cj-bad", *QA)
    assert code == 1 and "failed its last calibration" in err
    assert "exa serve challenger calibrate --judge-model cj-bad --set FILE" in err
    assert len(engine.bodies) == calls


def test_a_replaced_judge_endpoint_needs_a_new_calibration(stack: Stack, engine: RecordingServer) -> None:
    register_judge(stack, engine, "cj-swap", served="judge-a")
    engine.answers[:] = [verdict(label) for label in LABELS]
    assert calibrate(stack, "cj-swap")[0] == 0
    engine.answers[:] = [verdict("pass")]
    assert judge(stack, "cj-swap", *QA)[0] == 0

    register_judge(stack, engine, "cj-swap", served="judge-b")  # RegisterEndpoint with replace
    calls = len(engine.bodies)
    code, _out, err = judge(stack, "cj-swap", *QA)
    assert code == 1 and "recalibrated" in err and "judge-b" in err
    assert "exa serve challenger calibrate --judge-model cj-swap --set FILE" in err
    assert len(engine.bodies) == calls

    engine.answers[:] = [verdict(label) for label in LABELS]
    assert calibrate(stack, "cj-swap")[0] == 0
    engine.answers[:] = [verdict("pass", 0.8)]
    code, out, err = judge(stack, "cj-swap", *QA)
    assert code == 0 and out.split() == ["pass", "score", "0.80"], err

    # removed and registered again with the same model: another endpoint (its creation time), so again
    stack.registry().RemoveEndpoint(reg.RemoveEndpointRequest(name="cj-swap", actor="tests"), timeout=10)
    register_judge(stack, engine, "cj-swap", served="judge-b")
    code, _out, err = judge(stack, "cj-swap", *QA)
    assert code == 1 and "recalibrated" in err


def test_bad_set_files_are_refused_naming_the_line(stack: Stack, engine: RecordingServer, tmp_path: Path) -> None:
    register_judge(stack, engine, "cj-lines")
    good = SET.read_text().splitlines()

    def with_line(number: int, text: str) -> list[str]:
        return [text if i == number else line for i, line in enumerate(good, start=1)]

    cases = {
        "not JSON": (with_line(3, '{"question": "x",'), "line 3: not JSON"),
        "bad label": (with_line(5, json.dumps({"question": "q", "answer": "a", "label": "maybe"})),
                      "line 5: 'label' must be"),
        "no label": (with_line(7, json.dumps({"question": "q", "answer": "a"})), "line 7: 'label'"),
        "empty answer": (with_line(2, json.dumps({"question": "q", "answer": " ", "label": "pass"})),
                         "line 2: 'answer' must be a non-empty string"),
        "typo": (with_line(10, json.dumps({"question": "q", "answer": "a", "lable": "pass"})),
                 "line 10: unknown field(s) lable"),
        "not an object": (with_line(12, "[1, 2]"), "line 12: expected a JSON object"),
        "too few": (good[:9], "9 item(s); a calibration needs at least 10"),
    }
    calls = len(engine.bodies)
    for name, (lines, expected) in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        code, _report, err = calibrate(stack, "cj-lines", set_file=path)
        assert code == 1, name
        assert expected in json.loads(err)["error"], (name, err)
    missing = stack.cli("serve", "challenger", "calibrate", "--judge-model", "cj-lines", "--set",
                        str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 1 and "cannot read it" in missing.stderr
    assert len(engine.bodies) == calls and recorded(stack, "cj-lines") is None


def test_an_unreachable_gateway_fails_clearly_and_records_nothing(stack: Stack, engine: RecordingServer) -> None:
    register_judge(stack, engine, "cj-nogw")
    dead = f"http://127.0.0.1:{free_port()}"
    out = stack.cli("serve", "challenger", "calibrate", "--judge-model", "cj-nogw", "--set", str(SET),
                    env={"EXAMLOPS_GATEWAY_URL": dead})
    assert out.returncode == 1
    assert f"cannot reach the gateway at {dead}" in out.stderr and "nothing recorded" in out.stderr
    assert "Traceback" not in out.stderr
    assert recorded(stack, "cj-nogw") is None

    engine.answers[:] = [verdict(label) for label in LABELS]
    assert calibrate(stack, "cj-nogw")[0] == 0
    out = stack.cli("serve", "challenger", "judge", "--judge-model", "cj-nogw", *QA, env={"EXAMLOPS_GATEWAY_URL": dead})
    assert out.returncode == 1 and f"cannot reach the gateway at {dead}" in out.stderr
