"""The one adapter interface: plan, start, status, stop.

Only how a process starts and where its address comes from differ between substrates. An
adapter does the substrate's part and nothing else; the servicer does the registry's part
(registration, state, audit), the probe, and endpoint discovery, the same way for every adapter.
"""

from __future__ import annotations

import json
import os
import shlex
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import grpc

from examlops.engine import VLLM_API_KEY_ENV, EngineBlock, EngineBlockError, VllmCommand, render_vllm_command
from examlops.launcher.v1 import launcher_pb2 as pb
from examlops.registry.v1 import registry_pb2 as reg

from .._settings import LauncherSettings

#: Environment variables whose value never appears in a plan, a script or a log.
SECRET_ENV = frozenset({VLLM_API_KEY_ENV})


class LaunchError(Exception):
    """A start or stop the substrate (or the request) refused; one clear line for the operator."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, param: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.param = code, reason, param


@dataclass(frozen=True)
class LaunchSpec:
    """A validated start request: what to serve, where, and with which resources."""

    name: str
    launcher: str
    block: EngineBlock | None        # None only for an external endpoint registered without a block
    block_json: str
    base_url: str                    # external: where the server listens
    project: str
    nodes: int
    gpus_per_node: int
    partition: str
    walltime: str
    port: int
    actor: str
    model_version: str = ""          # NAME@V whose folder hf_model_id names, when serving a registered version
    #: The replicas this start (or scale-up) brings up, by id: r0, r1, ... The number in an id picks
    #: its own files and, on HPC, its port (port + number), so replicas sharing a node never collide.
    replica_ids: tuple[str, ...] = ("r0",)
    base_urls: tuple[str, ...] = ()  # external: one per replica
    first_index: int = 0             # compose: containers of the service already running (scale-up)

    @property
    def tp(self) -> int:
        return self.block.tensor_parallel_size if self.block is not None else 1

    @property
    def pp(self) -> int:
        return self.block.pipeline_parallel_size if self.block is not None else 1


@dataclass
class Prepared:
    """What a start would do (the plan, secrets redacted) and the secrets it needs."""

    plan: pb.LaunchPlan
    secret_env: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)   # non-secret environment of the substrate command


def replica_number(replica_id: str) -> int:
    """r3 -> 3; an id not of that form (or empty: a record from before pools) counts as 0."""
    digits = replica_id[1:] if replica_id.startswith("r") else ""
    return int(digits) if digits.isdigit() else 0


def replicas_of(ep: reg.Endpoint) -> list[reg.Replica]:
    """The pool of an endpoint; a record without replicas is its own only replica (id "")."""
    if ep.replicas:
        return list(ep.replicas)
    return [reg.Replica(base_url=ep.base_url, job_id=ep.job_id, state=ep.state, state_reason=ep.state_reason,
                        source=ep.launcher or "external")]


@dataclass
class Submission:
    """What the substrate answered to the start of one replica."""

    replica_id: str
    source: str                      # external, slurm:<job>, compose:vllm#<i>, kserve:<name>
    job_id: str
    base_url: str
    state: int                       # the endpoint state to record (reg.ENDPOINT_STATE_*)
    reason: str
    hpc_job: reg.HpcJob | None = None


@dataclass
class SubstrateView:
    """The substrate's view of an endpoint's job or container."""

    fields: dict[str, str]           # shown by `exa serve llm status`
    alive: bool | None = None        # False: the job/container is gone; None: not applicable/unknown
    state: str = ""                  # the substrate's own word: RUNNING, PENDING, CANCELLED, running, ...
    base_url: str = ""               # an address the job published (endpoint file), if any
    detail: str = ""                 # why it is in that state


class Adapter(ABC):
    """One substrate."""

    name: ClassVar[str]

    def __init__(self, settings: LauncherSettings) -> None:
        self.settings = settings

    @abstractmethod
    def plan(self, spec: LaunchSpec) -> Prepared:
        """Render exactly what `start` would submit. Pure: changes nothing anywhere."""

    @abstractmethod
    async def start(self, spec: LaunchSpec, prepared: Prepared) -> list[Submission]:
        """Submit `prepared`: one Submission per replica of spec.replica_ids, in that order. When
        the substrate refuses one, what was already started is undone and LaunchError raised."""

    @abstractmethod
    async def status(self, ep: reg.Endpoint, replica: reg.Replica) -> SubstrateView:
        """The substrate's view of one replica; for HPC also the address its job published, if it has."""

    @abstractmethod
    def stop_plan(self, ep: reg.Endpoint, replicas: Sequence[reg.Replica]) -> pb.LaunchPlan:
        """What stopping these replicas (all of them: the endpoint) would run."""

    @abstractmethod
    async def stop(self, ep: reg.Endpoint, replica: reg.Replica) -> str:
        """Cancel one replica's job / stop its container; returns what was done. LaunchError on refusal."""

    async def stop_all(self, ep: reg.Endpoint) -> str:
        """Stop every replica the launcher started (an external one is not ours to stop)."""
        done = [await self.stop(ep, r) for r in replicas_of(ep) if started_here(r)]
        return "; ".join(done) or "nothing to stop"

    async def close(self) -> None:
        return None


def started_here(replica: reg.Replica) -> bool:
    """Whether the launcher started this replica's server (and so stops it)."""
    return replica.source != "external"


def render(spec: LaunchSpec, *, host: str | None, port: int | None,
           environ: Mapping[str, str] | None = None) -> VllmCommand:
    """The block's `vllm serve` command through THE renderer; a missing API key is one clear error."""
    assert spec.block is not None
    try:
        return render_vllm_command(spec.block, host=host, port=port,
                                   environ=os.environ if environ is None else environ)
    except EngineBlockError as exc:
        raise LaunchError(grpc.StatusCode.FAILED_PRECONDITION, "engine_block_unrenderable",
                          f"cannot render the vllm command of {spec.name!r}: {exc}", "engine_block") from None


def split_env(env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) parts of an environment."""
    plain = {k: v for k, v in env.items() if k not in SECRET_ENV}
    secret = {k: v for k, v in env.items() if k in SECRET_ENV}
    return plain, secret


def redacted(env: Mapping[str, str]) -> dict[str, str]:
    return {k: ("***" if k in SECRET_ENV else v) for k, v in env.items()}


def shell_line(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """A command as an operator would type it; secret values redacted."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in redacted(env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(argv)


def block_summary(spec: LaunchSpec) -> str:
    block = json.loads(spec.block_json) if spec.block_json else {}
    return str(block.get("hf_model_id") or "(no model)")
