"""`make up` with the real CPU vLLM, the README's first command, on shifted ports and a temporary run dir.

One start of both vLLM servers (SmolLM2 and MiniLM, in parallel): up answers through the gateway,
the openai client chats with SmolLM2 (as `smol` and as `default`) and embeds with MiniLM, then the
SmolLM2 API server is SIGKILLed as the OOM killer would and `down` must still stop its engine core.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from examlops.engine import require_vllm_python
from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_devstack import StackPorts, group_members
from examlops_devstack._up import PARTS, RunDir
from examlops_testsupport import REPO_ROOT
from examlops_testsupport.fixtures import ports_free
from examlops_testsupport.vllm import minilm_model_dir, smol_model_dir

pytestmark = pytest.mark.vllm


def _devstack(run: RunDir, offset: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EXAMLOPS_DEV_PORT_OFFSET": str(offset), "VLLM_CPU_KVCACHE_SPACE": "1",
           "EXAMLOPS_USECASE_DIR": str(REPO_ROOT / "usecases")}
    return subprocess.run([sys.executable, "-m", "examlops_devstack", "--run-dir", str(run.root), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _in_group(pid: int, pgids: set[int]) -> bool:
    """Alive and in one of `pgids` as its process group or session, ours or not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, _ppid, pgrp, session = f.read().rsplit(") ", 1)[1].split()[:4]
    except OSError:
        return False
    return state not in ("Z", "X") and bool({int(pgrp), int(session)} & pgids)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _lost_a_port(run: RunDir, up: subprocess.CompletedProcess[str]) -> bool:
    """Whether `up` failed because a port it checked free was taken before its server bound it: the
    stack's ports (50051+ shifted) lie in the kernel's ephemeral range, where any outgoing connection
    made meanwhile on this machine can take one. Not the stack's fault; the test tries other ports."""
    logs = [p.read_text(errors="replace") for p in run.logs.glob("*.log")] if run.logs.is_dir() else []
    return any("Address already in use" in text for text in (up.stderr, *logs))


@pytest.mark.timeout(900)
def test_make_up_serves_smollm2_and_minilm_and_down_stops_an_engine_core_after_an_api_server_kill(
        tmp_path: Path) -> None:
    venv, model_dir = require_vllm_python().parent.parent, smol_model_dir()
    # 15 apart: one offset's ports (gRPC 50051-50054 and metrics 50061-50064, shifted) clear the next's
    offsets = (o for o in range(4000, 4600, 15) if ports_free(StackPorts.with_offset(o)))
    for attempt in range(3):
        offset = next(offsets)
        ports, run = StackPorts.with_offset(offset), RunDir((tmp_path / f"run{attempt}").resolve())
        up = _devstack(run, offset, "up", "--engine", "vllm", "--vllm-venv", str(venv), "--model-dir", str(model_dir),
                       "--minilm-dir", str(minilm_model_dir()), timeout=800)
        if up.returncode == 0 or not _lost_a_port(run, up):
            break
        print(f"offset {offset}: a port was taken while the stack came up; trying another\n{up.stderr[-1500:]}")
        assert _devstack(run, offset, "down").returncode == 0
    try:
        assert up.returncode == 0, up.stderr[-4000:]
        first = re.search(r"smol answered through the gateway in [\d.]+ s: (.+)", up.stderr)
        assert first is not None and not first.group(1).startswith(("'echo", '"echo')), up.stderr[-2000:]
        assert re.search(r"minilm embedded through the gateway in [\d.]+ s: 384 dimensions", up.stderr)
        healthy = [float(t) for t in re.findall(r"(?:vllm|minilm) healthy after (\d+) s", up.stderr)]
        assert len(healthy) == 2, up.stderr[-2000:]  # waited for together, not one after the other
        assert f"OpenAI(base_url=\"{ports.gateway_url}/v1\"" in up.stdout and '"model": "minilm"' in up.stdout

        client = openai.OpenAI(base_url=ports.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
        for route in ("smol", "default"):  # default: the same SmolLM2 server (exa rag query's route)
            reply = client.chat.completions.create(model=route, max_tokens=16,
                                                   messages=[{"role": "user", "content": "Say hello."}])
            assert (reply.choices[0].message.content or "").strip()
            assert reply.usage is not None and reply.usage.completion_tokens > 0
        vectors = client.embeddings.create(model="minilm", input=["A cat sits on the mat.", "Stocks fell."])
        assert [len(d.embedding) for d in vectors.data] == [384, 384] and vectors.usage.prompt_tokens > 0
        rows = {r["part"]: r for r in json.loads(_devstack(run, offset, "status", "--json").stdout)}
        assert rows["prometheus"]["healthy"] and rows["prometheus"]["address"] == ports.prometheus_url
        assert rows["minilm"] == {
            "part": "minilm", "pid": run.pid("minilm"), "healthy": True, "address": f"http://127.0.0.1:{ports.minilm}",
            "log": str(run.logs / "minilm.log")}

        pgids = {p: run.recorded(p) for p in PARTS}
        api_server = pgids["vllm"]
        assert api_server is not None
        vllm = group_members(api_server, run.marker, run.known("vllm"))
        engine_core = [p for p in vllm if "EngineCore" in _cmdline(p)]
        assert api_server in vllm and engine_core, {p: _cmdline(p) for p in vllm}

        os.kill(api_server, signal.SIGKILL)  # as the OOM killer would
        deadline = time.monotonic() + 10
        while _in_group(api_server, {api_server}):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert all(_in_group(p, {api_server}) for p in engine_core), "the engine core outlives its API server"
    finally:
        down = _devstack(run, offset, "down")
    assert down.returncode == 0, down.stderr
    assert re.search(r"vllm: stopped \d+ leftover process\(es\) whose leader", down.stderr), down.stderr
    assert down.stderr.count("stopped") == len(PARTS)
    groups = {g for g in pgids.values() if g is not None}
    assert len(groups) == len(PARTS)
    assert [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _in_group(p, groups)] == []
    assert not list((run.root / "pids").glob("*.pid"))
