"""The five substrate adapters behind one interface (plan, start, status, stop)."""

from __future__ import annotations

from .._settings import LauncherSettings
from .._transport import LocalTransport, SshTransport, Transport
from ._base import (
    Adapter,
    LaunchError,
    LaunchSpec,
    Prepared,
    Submission,
    SubstrateView,
    replica_number,
    replicas_of,
    started_here,
)
from ._compose import ComposeAdapter
from ._external import ExternalAdapter
from ._flux import FluxAdapter
from ._hpc import HpcAdapter, parse_endpoint_file, walltime_seconds
from ._kserve import KServeAdapter
from ._slurm import SlurmAdapter

LAUNCHERS = ("external", "compose", "slurm", "flux", "kserve")


def build_transport(settings: LauncherSettings) -> Transport:
    """Where sbatch/flux run: here, or on the login node over one SSH connection."""
    if settings.hpc_transport == "ssh":
        if not settings.hpc_ssh_host:
            raise SystemExit("EXAMLOPS_HPC_TRANSPORT=ssh needs EXAMLOPS_HPC_SSH_HOST ([user@]host[:port])")
        return SshTransport(settings.hpc_ssh_host, key_file=settings.hpc_ssh_key_file,
                            known_hosts=settings.hpc_ssh_known_hosts, connect_timeout_s=settings.hpc_ssh_timeout_s)
    return LocalTransport()


def build_adapters(settings: LauncherSettings, transport: Transport | None = None) -> dict[str, Adapter]:
    """One adapter per launcher name; Slurm and Flux share the HPC transport."""
    hpc = transport or build_transport(settings)
    adapters: list[Adapter] = [ExternalAdapter(settings), ComposeAdapter(settings), SlurmAdapter(settings, hpc),
                               FluxAdapter(settings, hpc), KServeAdapter(settings)]
    return {a.name: a for a in adapters}


__all__ = ["LAUNCHERS", "Adapter", "HpcAdapter", "LaunchError", "LaunchSpec", "Prepared", "Submission",
           "SubstrateView", "build_adapters", "build_transport", "parse_endpoint_file", "replica_number", "replicas_of",
           "started_here", "walltime_seconds"]
