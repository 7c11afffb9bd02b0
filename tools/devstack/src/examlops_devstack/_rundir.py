"""The run directory of `make up` (`.run/`): pid files, logs, the port offset; and the stop of a part."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ._procs import RUN_DIR_ENV, Proc, group_members, start_time, stop_group

BOLD, DIM, GREEN, RED, RESET = "\033[1m", "\033[2m", "\033[32m", "\033[31m", "\033[0m"


def say(msg: str) -> None:
    sys.stderr.write(f"{BOLD}==>{RESET} {msg}\n")
    sys.stderr.flush()


@dataclass
class RunDir:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def pidfile(self, part: str) -> Path:
        return self.root / "pids" / f"{part}.pid"

    @property
    def env(self) -> dict[str, str]:
        """Set on every process `up` starts: how `down` knows a member of a recorded group is ours."""
        return {RUN_DIR_ENV: str(self.root)}

    @property
    def marker(self) -> str:
        return f"{RUN_DIR_ENV}={self.root}"

    def _lines(self, part: str) -> list[list[int]]:
        try:
            return [[int(v) for v in line.split()] for line in self.pidfile(part).read_text().splitlines()]
        except (OSError, ValueError):
            return []

    def recorded(self, part: str) -> int | None:
        """The recorded leader pid (= process group and session id) of `part`, alive or not."""
        lines = self._lines(part)
        return lines[0][0] if lines and lines[0] else None

    def known(self, part: str) -> dict[int, int]:
        """pid -> start time of the members of `part` seen while its leader was alive."""
        return {line[0]: line[1] for line in self._lines(part)[1:] if len(line) == 2}

    def pid(self, part: str) -> int | None:
        """The leader pid of `part` when that very leader (same pid, same start time) is alive."""
        pid = self.recorded(part)
        if pid is None or start_time(pid) is None or start_time(pid) != self.known(part).get(pid):
            return None
        return pid

    def record(self, part: str, proc: Proc) -> None:
        """Write the part's pid file: its leader, then pid and start time of each member seen so far
        (vLLM's engine core wipes its environment, so the marker alone cannot find it later)."""
        proc.remember_group()
        known = {**self.known(part), **proc.known} if self.recorded(part) == proc.pid else proc.known
        self.pidfile(part).parent.mkdir(parents=True, exist_ok=True)
        self.pidfile(part).write_text("".join([f"{proc.pid}\n", *(f"{p} {t}\n" for p, t in sorted(known.items()))]))

    def stop(self, part: str) -> list[int]:
        """Stop every process of the part's group that is ours; forget the part once none is left."""
        pgid = self.recorded(part)
        if pgid is None:
            return []
        found = stop_group(pgid, self.marker, self.known(part), timeout_s=20)
        if left := group_members(pgid, self.marker, self.known(part)):
            say(f"{RED}{part}: pids {' '.join(map(str, left))} survived SIGKILL; {self.pidfile(part)} kept{RESET}")
        else:
            self.forget(part)
        return found

    def forget(self, part: str) -> None:
        self.pidfile(part).unlink(missing_ok=True)

    def port_offset(self) -> int:
        """The port offset of the stack this run dir holds (0 when none): the CLI reads the same file
        (examlops_cli._config.PORT_OFFSET_FILE) to find the running stack."""
        try:
            return int((self.root / "port-offset").read_text().strip())
        except (OSError, ValueError):
            return 0

    def record_port_offset(self, offset: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "port-offset").write_text(f"{offset}\n")
