"""slurm: sbatch the rendered job script, scancel it, read its state from scontrol (or sacct)."""

from __future__ import annotations

from .._transport import CommandResult
from ._hpc import HpcAdapter

#: scontrol's JobState values after which a job never runs again.
SLURM_TERMINAL = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT", "GONE",
})
#: scontrol's fields worth showing an operator, under our names.
_FIELDS = {"JobState": "job_state", "Reason": "reason", "NodeList": "nodes", "RunTime": "run_time",
           "TimeLimit": "time_limit", "StartTime": "start_time", "ExitCode": "exit_code",
           "Partition": "partition", "TresPerNode": "tres_per_node"}


class SlurmAdapter(HpcAdapter):
    name = "slurm"
    scheduler = "slurm"
    terminal_states = SLURM_TERMINAL
    log_pattern = "%j"

    def submit_argv(self, script_path: str) -> list[str]:
        return ["sbatch", "--parsable", script_path]

    def parse_job_id(self, result: CommandResult) -> str:
        # --parsable prints "<id>" or "<id>;<cluster>".
        return result.stdout.strip().splitlines()[-1].split(";")[0].strip()

    def cancel_argv(self, job_id: str) -> list[str]:
        return ["scancel", job_id]

    def already_gone(self, result: CommandResult) -> bool:
        text = result.error_line().lower()
        return "invalid job id" in text or "already completed" in text or "job has finished" in text

    async def job_state(self, job_id: str) -> tuple[str, dict[str, str]]:
        timeout = self.settings.hpc_command_timeout_s
        shown = await self.transport.run(["scontrol", "show", "job", "-o", job_id], timeout_s=timeout)
        if shown.ok:
            raw = dict(token.split("=", 1) for token in shown.stdout.split() if "=" in token)
            fields = {ours: raw[theirs] for theirs, ours in _FIELDS.items() if theirs in raw}
            return raw.get("JobState", "UNKNOWN"), fields
        # The controller forgets a finished job after MinJobAge; accounting may still know it.
        acct = await self.transport.run(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode,NodeList", "-j", job_id],
                                        timeout_s=timeout)
        line = acct.stdout.strip().splitlines()[0] if acct.ok and acct.stdout.strip() else ""
        if line:
            state, exit_code, nodes = [*line.split("|"), "", ""][:3]
            return state.split()[0], {"exit_code": exit_code, "nodes": nodes}
        return "GONE", {"reason": "the scheduler no longer knows the job"}
