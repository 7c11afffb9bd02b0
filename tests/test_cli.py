"""The `exa` CLI as an operator runs it, against the real services."""

from __future__ import annotations

import json

from examlops_testsupport.fixtures import Stack, free_port, wait_until


def test_start_list_health_chat_stop_audit(stack: Stack) -> None:
    out = stack.cli("--json", "serve", "llm", "start", "cli-echo", "--engine", "echo", "--project", "demo")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == "READY"

    listed = json.loads(stack.cli("serve", "llm", "list", "--project", "demo", "--json").stdout)
    assert [e["name"] for e in listed] == ["cli-echo"]
    stopped = json.loads(stack.cli("serve", "llm", "list", "--state", "stopped", "--json").stdout)
    assert "cli-echo" not in {e["name"] for e in stopped} and all(e["state"] == "STOPPED" for e in stopped)

    assert stack.cli("serve", "llm", "health", "cli-echo").returncode == 0

    chat = stack.cli("serve", "llm", "chat", "cli-echo", "-m", "direct line")
    assert chat.returncode == 0 and chat.stdout.strip() == "echo: direct line"
    streamed = stack.cli("serve", "llm", "chat", "cli-echo", "-m", "streamed line", "--stream")
    assert streamed.stdout.strip() == "echo: streamed line"
    usage = json.loads(stack.cli("--json", "serve", "llm", "chat", "cli-echo", "-m", "a b").stdout)["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 3}

    wait_until(lambda: stack.cli("gateway", "chat", "cli-echo", "--message", "via gw").stdout.strip() == "echo: via gw")

    stop = stack.cli("serve", "llm", "stop", "cli-echo")
    assert stop.returncode == 0 and "STOPPED" in stop.stdout
    wait_until(lambda: stack.cli("gateway", "chat", "cli-echo", "--message", "x").returncode == 1)
    refused = stack.cli("gateway", "chat", "cli-echo", "--message", "x")
    assert "model_not_found" in refused.stderr and "STOPPED" in refused.stderr

    events = json.loads(stack.cli("--json", "audit", "list", "--target", "endpoint:cli-echo").stdout)
    assert [e["action"] for e in events][:2] == ["stop", "health"] and events[-1]["action"] == "register"
    assert {e["target"] for e in events} == {"endpoint:cli-echo"}


def test_health_is_a_ci_gate(stack: Stack) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert stack.cli("serve", "llm", "start", "cli-dead", "--base-url", dead, "--hf-model", "org/m").returncode == 0
    out = stack.cli("serve", "llm", "health", "cli-dead")
    assert out.returncode == 1 and "unreachable" in out.stdout
    listed = json.loads(stack.cli("--json", "serve", "llm", "list").stdout)
    assert next(e for e in listed if e["name"] == "cli-dead")["state"] == "FAILED"


def test_errors_are_one_clear_line(stack: Stack) -> None:
    cases = [
        (["serve", "llm", "health", "nope"], "no endpoint named 'nope'"),
        (["serve", "llm", "start", "x", "--launcher", "nomad"], "unknown launcher 'nomad'"),
        (["serve", "llm", "start", "Bad Name", "--engine", "echo"], "invalid endpoint name"),
        (["serve", "llm", "list", "--state", "sleepy"], "unknown state 'sleepy'"),
        (["serve", "llm", "chat", "nope", "-m", "x"], "no endpoint named 'nope'"),
        (["gateway", "chat", "nope", "-m", "x", "--key", "wrong"], "invalid_api_key"),
    ]
    for args, expected in cases:
        out = stack.cli(*args)
        assert out.returncode == 1, (args, out.stdout)
        assert expected in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "Traceback" not in out.stderr


def test_unreachable_stack_names_the_fix(stack: Stack) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, **stack.env(), "EXAMLOPS_REGISTRY_ADDR": f"127.0.0.1:{free_port()}", "COLUMNS": "200"}
    out = subprocess.run([str(Path(sys.executable).parent / "exa"), "serve", "llm", "list"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 1
    assert "cannot reach registry" in out.stderr and "make up" in out.stderr


def test_dev_env_prints_exports(stack: Stack) -> None:
    out = stack.cli("dev", "env")
    assert out.returncode == 0
    assert f"export EXAMLOPS_GATEWAY_URL={stack.gateway_url}" in out.stdout
    assert "export OPENAI_API_KEY=" in out.stdout


def test_start_takes_the_media_policy_from_flags(stack: Stack) -> None:
    out = stack.cli("--json", "serve", "llm", "start", "qwen-flags", "--base-url", "http://gpu01:8000",
                    "--hf-model", "Qwen/Qwen3-VL-8B-Instruct", "--modality", "vision", "--max-images", "2",
                    "--media-domains", "example.com", "--media-domains", "cdn.example.org")
    assert out.returncode == 0, out.stderr
    mm = json.loads(out.stdout)["engine_block"]["multimodal"]
    assert mm["modality"] == "vision" and mm["limit_mm_per_prompt"] == {"image": 2}
    assert mm["allowed_media_domains"] == ["example.com", "cdn.example.org"]
    refused = stack.cli("serve", "llm", "start", "qwen-flags2", "--base-url", "http://gpu01:8000",
                        "--hf-model", "org/vl", "--modality", "vision")
    assert refused.returncode == 1 and "limit_mm_per_prompt" in refused.stderr
