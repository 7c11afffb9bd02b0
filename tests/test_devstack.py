"""`make up` / `make status` / `make down` logic: idempotent start, exact stop (echo engine, shifted ports)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from examlops_devstack import Proc, StackPorts, free_port, spawn
from examlops_devstack._up import RunDir, down
from examlops_testsupport import REPO_ROOT
from examlops_testsupport.fixtures import ports_free

# A leader with three children, as `vllm serve` has its engine core and workers: one inherits the
# environment (marked as ours), one execs with an empty one (ours but unmarked, as vLLM's EngineCore
# is once setproctitle wiped its environment: known only from the pid file), and one starts with an
# empty environment after the pid file was written (a stranger, as far as anyone can tell).
TREE = """
import os, sys, time
def child(env):
    if os.fork() == 0:
        if env is None:
            time.sleep(600)
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)"], env)
child(None)
child({})
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
child({})
time.sleep(600)
"""


def _group(pgid: int) -> list[int]:
    """Every live process of the group, ours or not."""
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and _in_group(int(p), pgid))


def _in_group(pid: int, pgid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, _ppid, pgrp = f.read().rsplit(") ", 1)[1].split()[:3]
    except OSError:
        return False
    return state not in ("Z", "X") and int(pgrp) == pgid


def _wait_group(pgid: int, size: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(members := _group(pgid)) < size:
        assert time.monotonic() < deadline, members
        time.sleep(0.02)
    return members


@dataclass
class Tree:
    run: RunDir
    proc: Proc
    stranger: int

    def kill_leader(self) -> list[int]:
        """SIGKILL the leader as the OOM killer would; returns the children it leaves behind."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.popen.wait(timeout=5)
        left = _group(self.proc.pid)
        assert len(left) == 3, "the children outlive their leader"
        return left


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    """A process tree started and recorded the way `up` starts a part, as the run's vllm."""
    run = RunDir((tmp_path / ".run").resolve())
    go = tmp_path / "go"
    proc = spawn("vllm", [sys.executable, "-c", TREE, str(go)], run.env, run.logs / "vllm.log")
    ours = _wait_group(proc.pid, 3)
    run.record("vllm", proc)
    go.touch()
    stranger = next(p for p in _wait_group(proc.pid, 4) if p not in ours)
    yield Tree(run, proc, stranger)
    for pid in _group(proc.pid):  # whatever a failed test left
        os.kill(pid, signal.SIGKILL)


def test_down_stops_the_children_a_killed_leader_left_and_spares_strangers(
        tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    tree.kill_leader()
    down(tree.run)
    assert _group(tree.proc.pid) == [tree.stranger]
    assert "vllm: stopped 2 leftover process(es) whose leader" in capsys.readouterr().err
    assert not tree.run.pidfile("vllm").exists()


def test_proc_stop_stops_the_whole_group_even_after_its_leader_died(tmp_path: Path) -> None:
    """What the test fixtures do with a vLLM, whether its API server is alive or was killed."""
    for kill_leader_first in (False, True):
        proc = spawn("tree", [sys.executable, "-c", TREE, str(tmp_path / "never")], {}, tmp_path / "tree.log")
        try:
            _wait_group(proc.pid, 3)
            proc.remember_group()
            if kill_leader_first:
                os.kill(proc.pid, signal.SIGKILL)
                proc.popen.wait(timeout=5)
                assert len(_group(proc.pid)) == 2
            proc.stop()
            assert _group(proc.pid) == []
        finally:
            for pid in _group(proc.pid):
                os.kill(pid, signal.SIGKILL)


def _devstack(run_dir: Path, offset: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "examlops_devstack", "--run-dir", str(run_dir),
                           "--port-offset", str(offset), *args], capture_output=True, text=True, timeout=180)


def _exa_dev_env(cwd: Path, **env: str) -> dict[str, str]:
    """`exa dev env` run from `cwd` with no EXAMLOPS_* variable but `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EXAMLOPS_")}
    out = subprocess.run([str(Path(sys.executable).parent / "exa"), "dev", "env"], cwd=cwd, env={**clean, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())


def _addresses(ports: StackPorts) -> dict[str, str]:
    return {"EXAMLOPS_GATEWAY_URL": ports.gateway_url, "OPENAI_BASE_URL": ports.gateway_url + "/v1",
            **{f"EXAMLOPS_{name.upper().replace('-', '_')}_ADDR": ports.addr(name)
               for name in ("registry", "launcher", "engine-proxy", "mediaguard")}}


def test_free_port_stays_below_the_ephemeral_range_and_never_repeats() -> None:
    """A port in the ephemeral range can be taken by any outgoing connection before the test's server
    binds it (a CI run lost four tests to a launcher whose metrics port a Redis client had taken)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(port < max(low, 20000) for port in ports)


def test_exa_dev_env_prints_the_ports_of_the_stack_the_offset_selects(tmp_path: Path) -> None:
    assert _exa_dev_env(tmp_path).items() >= _addresses(StackPorts()).items()
    shifted = StackPorts.with_offset(100)
    assert _exa_dev_env(tmp_path, EXAMLOPS_DEV_PORT_OFFSET="100").items() >= _addresses(shifted).items()
    explicit = _exa_dev_env(tmp_path, EXAMLOPS_DEV_PORT_OFFSET="100", EXAMLOPS_GATEWAY_URL="http://gw:1")
    assert explicit["EXAMLOPS_GATEWAY_URL"] == "http://gw:1"
    assert explicit["EXAMLOPS_REGISTRY_ADDR"] == shifted.addr("registry")
    # A stack that `make up` runs from this checkout under an offset, seen from a sub-folder.
    RunDir((tmp_path / ".run").resolve()).record_port_offset(42)
    (tmp_path / "sub").mkdir()
    assert _exa_dev_env(tmp_path / "sub").items() >= _addresses(StackPorts.with_offset(42)).items()


def test_up_is_idempotent_and_down_stops_exactly_what_up_started(tree: Tree) -> None:
    offset = next(o for o in range(3000, 3300, 7) if ports_free(StackPorts.with_offset(o)))
    run = tree.run.root
    tree.kill_leader()  # a previous run's vLLM whose API server was killed
    try:
        first = _devstack(run, offset, "up", "--engine", "echo")
        assert first.returncode == 0, first.stderr
        assert "vllm: stopped 2 leftover process(es) of a previous run" in first.stderr
        assert _group(tree.proc.pid) == [tree.stranger]
        assert "answered through the gateway" in first.stderr and "echo: What is the capital" in first.stderr
        assert "OpenAI(base_url=" in first.stdout and f"Logs: {run / 'logs'}/ " in first.stdout
        # exa, from the checkout and with no variable set, finds this stack on its shifted ports.
        assert _exa_dev_env(run.parent).items() >= _addresses(StackPorts.with_offset(offset)).items()
        listed = subprocess.run([str(Path(sys.executable).parent / "exa"), "--json", "serve", "llm", "list"],
                                cwd=run.parent, capture_output=True, text=True, timeout=60,
                                env={k: v for k, v in os.environ.items() if not k.startswith("EXAMLOPS_")})
        assert listed.returncode == 0, listed.stderr
        # The chat model, `default` (exa rag query's route) and an echo stand-in for the embedding model.
        assert {e["name"] for e in json.loads(listed.stdout)} >= {"echo", "default", "minilm"}, listed.stdout
        assert "minilm embedded through the gateway" in first.stderr and "384 dimensions" in first.stderr
        assert '"model": "minilm", "input"' in first.stdout  # the banner's embeddings example
        status = json.loads(_devstack(run, offset, "status", "--json").stdout)
        up = {r["part"]: r for r in status}
        servers = ("vllm", "minilm")  # engine echo starts no vLLM
        assert all(up[p]["healthy"] for p in up if p not in servers) and not any(up[p]["healthy"] for p in servers)
        pids = {p: r["pid"] for p, r in up.items() if p not in servers}

        again = _devstack(run, offset, "up", "--engine", "echo")
        assert again.returncode == 0, again.stderr
        assert again.stderr.count("already running") == 8  # two Redis, the five services, Prometheus
        assert "prometheus: already running" in again.stderr and "configuration reloaded" in again.stderr
        assert {r["part"]: r["pid"] for r in json.loads(_devstack(run, offset, "status", "--json").stdout)
                if r["part"] not in servers} == pids
    finally:
        down = _devstack(run, offset, "down")
    assert down.returncode == 0
    assert down.stderr.count("stopped") == 8
    assert _devstack(run, offset, "status").returncode == 1
    assert not list((run / "pids").glob("*.pid"))
    assert not (run / "port-offset").exists()
    assert (run / "logs" / "gateway.log").exists()


def _make(*args: str, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    assert make is not None
    full_env = {**os.environ, **env, **({"PATH": path} if path else {})}
    return subprocess.run([make, "--no-print-directory", "-C", str(REPO_ROOT), *args], capture_output=True,
                          text=True, timeout=120, env=full_env)


def test_make_up_installs_only_redis_and_prometheus_and_make_test_the_launcher_test_daemons() -> None:
    for target in (["up"], ["up", "ENGINE=echo"]):
        plan = _make("-n", *target).stdout
        assert "redis-server" in plan and "install -y -qq prometheus" in plan
        assert not re.search(r"slurm|munge|sshd|openssh", plan), plan
    for tests in ("test", "test-fast"):
        plan = _make("-n", tests).stdout
        assert "scripts/slurm-local.sh install" in plan and "scripts/sshd-local.sh install" in plan


def test_system_deps_show_one_line_per_install_and_the_log_on_failure(tmp_path: Path) -> None:
    """apt-get (a stand-in printing as much as the real one) and neither redis-server nor prometheus on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mkdir", "tee", "grep", "tail", "env", "id", "hostname", "dirname"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "sudo").write_text('#!/bin/bash\nexec "$@"\n')
    (bin_dir / "apt-get").write_text(
        "#!/bin/bash\nfor ((i = 0; i < 200; i++)); do echo \"Get:$i http://deb.debian.org/debian noise $i\"; done\n"
        "echo 'debconf: unable to initialize frontend' >&2\n"
        "if [ \"$1\" = install ] && [ -n \"${FAIL_APT:-}\" ]; then\n"
        "  echo 'E: Unable to locate package' >&2; exit 100\nfi\n")
    for script in ("sudo", "apt-get"):
        (bin_dir / script).chmod(0o755)
    log = tmp_path / "logs" / "deps.log"

    ok = _make("system-deps", f"DEPS_LOG={log}", path=str(bin_dir))
    assert ok.returncode == 0, ok.stderr
    shown = (ok.stdout + ok.stderr).strip().splitlines()
    assert len(shown) == 2 and shown[0].startswith("==> Installing redis-server"), shown  # one line a package
    assert shown[1].startswith("==> Installing prometheus"), shown
    assert "noise 199" in log.read_text() and "debconf" in log.read_text()

    failed = _make("system-deps", f"DEPS_LOG={log}", path=str(bin_dir), FAIL_APT="1")
    assert failed.returncode != 0
    assert "E: Unable to locate package" in failed.stderr and "noise" in failed.stderr
