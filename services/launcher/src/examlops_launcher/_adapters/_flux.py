"""flux: `flux batch` the rendered job script, `flux cancel` it, read its state from `flux jobs`.

UNVERIFIED against a real Flux: no package on our registries provides the `flux` broker, so
only the rendered script (bash -n, directives, the `flux run` launch path) and the argv given
to `flux` are tested. The commands follow flux-core's documented CLI (flux batch/run/cancel/
jobs/hostlist).
"""

from __future__ import annotations

from .._transport import CommandResult
from ._hpc import HpcAdapter

#: `flux jobs` {status} values of a job that will not run again.
FLUX_TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELED", "TIMEOUT", "INACTIVE", "GONE"})


class FluxAdapter(HpcAdapter):
    name = "flux"
    scheduler = "flux"
    terminal_states = FLUX_TERMINAL
    log_pattern = "{{id}}"

    def submit_argv(self, script_path: str) -> list[str]:
        return ["flux", "batch", script_path]

    def parse_job_id(self, result: CommandResult) -> str:
        # flux batch prints the new job's id (f58, e.g. ƒ2Nq6ZbYDq) on stdout.
        return result.stdout.strip().splitlines()[-1].strip()

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["flux", "cancel", job_id]

    def already_gone(self, result: CommandResult) -> bool:
        text = result.error_line().lower()
        return "inactive" in text or "not found" in text or "unknown job" in text

    async def job_state(self, job_id: str) -> tuple[str, dict[str, str]]:
        shown = await self.transport.run(
            ["flux", "jobs", "--no-header", "--format={status} {nodelist} {runtime!F}", job_id],
            timeout_s=self.settings.hpc_command_timeout_s)
        parts = shown.stdout.split()
        if not shown.ok or not parts:
            return "GONE", {"reason": shown.error_line() if not shown.ok else "flux jobs knows no such job"}
        fields = {"nodes": parts[1] if len(parts) > 1 else "", "run_time": parts[2] if len(parts) > 2 else ""}
        return parts[0].upper(), fields
