"""How scheduler commands and files reach the login node: locally, or over one SSH connection.

The SSH transport keeps ONE paramiko connection for the launcher's lifetime (opened on first
use, re-opened when it drops) and uses it for commands (exec) and files (SFTP). Environment
values for a command travel on the command's stdin, never on its command line, so a secret
such as VLLM_API_KEY is visible neither in `ps` on the login node nor in sshd's logs, and no
`AcceptEnv` is needed on the server.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Reads NAME=value lines from stdin, exports them, then runs "$@" (the real command).
_ENV_FROM_STDIN = 'while IFS= read -r kv; do export "$kv"; done; exec "$@"'


class TransportError(RuntimeError):
    """The login node cannot be reached (or a file on it cannot be written)."""


@dataclass(frozen=True)
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_line(self) -> str:
        """The command's own complaint, on one line."""
        text = (self.stderr.strip() or self.stdout.strip() or f"exit status {self.returncode}")
        return " ".join(text.split())


def _check_env(env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not _ENV_NAME.match(name) or "\n" in value or "\0" in value:
            raise ValueError(f"environment variable {name!r} cannot be passed to a command")


class Transport(ABC):
    """Runs commands and reads/writes files where the scheduler's client commands live."""

    name: str

    @abstractmethod
    def describe(self) -> str:
        """`local`, or `ssh user@host:port`."""

    @abstractmethod
    async def run(self, argv: list[str], *, env: Mapping[str, str] | None = None,
                  timeout_s: float = 60.0) -> CommandResult:
        """Run argv with `env` added to its environment; never raises for a non-zero exit."""

    @abstractmethod
    async def write_file(self, path: str, text: str, mode: int = 0o644) -> None: ...

    @abstractmethod
    async def read_file(self, path: str) -> str | None:
        """The file's text, or None when it does not exist."""

    @abstractmethod
    async def remove_file(self, path: str) -> bool:
        """Remove the file; False when there was none."""

    async def close(self) -> None:
        return None


class LocalTransport(Transport):
    name = "local"

    def describe(self) -> str:
        return "local"

    async def run(self, argv: list[str], *, env: Mapping[str, str] | None = None,
                  timeout_s: float = 60.0) -> CommandResult:
        _check_env(env or {})
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})})
        except FileNotFoundError:
            return CommandResult(argv, 127, "", f"{argv[0]}: command not found")
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return CommandResult(argv, 124, "", f"{argv[0]} did not answer within {timeout_s:.0f} s")
        return CommandResult(argv, proc.returncode or 0, out.decode(errors="replace"),
                             err.decode(errors="replace"))

    async def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        def write() -> None:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_text(text)
            tmp.chmod(mode)
            tmp.replace(target)
        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            raise TransportError(f"cannot write {path}: {exc.strerror or exc}") from None

    async def read_file(self, path: str) -> str | None:
        try:
            return await asyncio.to_thread(Path(path).read_text)
        except FileNotFoundError:
            return None

    async def remove_file(self, path: str) -> bool:
        try:
            await asyncio.to_thread(Path(path).unlink)
        except FileNotFoundError:
            return False
        return True


def parse_ssh_host(value: str, default_user: str) -> tuple[str, str, int]:
    """`[user@]host[:port]` → (user, host, port)."""
    user, _, hostport = value.rpartition("@")
    host, port = hostport, 22
    if hostport.count(":") == 1:
        host, _, raw_port = hostport.partition(":")
        port = int(raw_port)
    return user or default_user, host, port


class SshTransport(Transport):
    """One long-lived paramiko connection to the login node, used from a worker thread."""

    name = "ssh"

    def __init__(self, host: str, *, key_file: str = "", known_hosts: str = "",
                 connect_timeout_s: float = 10.0) -> None:
        self.user, self.host, self.port = parse_ssh_host(host, os.environ.get("USER") or "root")
        self.key_file = key_file
        self.known_hosts = known_hosts
        self.connect_timeout_s = connect_timeout_s
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"ssh {self.user}@{self.host}:{self.port}"

    # --- connection (worker thread only) ---

    def _connect(self) -> paramiko.SSHClient:
        client = self._client
        transport = client.get_transport() if client is not None else None
        if client is not None and transport is not None and transport.is_active():
            return client
        self._close_sync()
        client = paramiko.SSHClient()
        client.load_system_host_keys()
        if self.known_hosts:
            client.load_host_keys(self.known_hosts)
        # An unknown host key is refused: the launcher hands this host API keys and job scripts.
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(self.host, port=self.port, username=self.user,
                           key_filename=self.key_file or None, timeout=self.connect_timeout_s,
                           banner_timeout=self.connect_timeout_s, auth_timeout=self.connect_timeout_s,
                           allow_agent=not self.key_file, look_for_keys=not self.key_file)
        except (OSError, paramiko.SSHException) as exc:
            client.close()
            raise TransportError(
                f"cannot reach the login node {self.user}@{self.host}:{self.port} over SSH: "
                f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        keepalive = client.get_transport()
        if keepalive is not None:
            keepalive.set_keepalive(30)
        self._client = client
        return client

    def _sftp_client(self) -> paramiko.SFTPClient:
        client = self._connect()
        channel = self._sftp.get_channel() if self._sftp is not None else None
        if self._sftp is None or channel is None or channel.closed:
            self._sftp = client.open_sftp()
        return self._sftp

    def _close_sync(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
            self._sftp = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            try:
                return fn(*args)
            except TransportError:
                raise
            except (OSError, EOFError, paramiko.SSHException) as exc:
                # A dropped connection: forget it, so the next call opens a fresh one.
                self._close_sync()
                raise TransportError(f"SSH to {self.host} failed: {type(exc).__name__}: {exc}") from None

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(self._locked, fn, *args)

    # --- operations ---

    def _run_sync(self, argv: list[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
        client = self._connect()
        command = shlex.join(["bash", "-c", _ENV_FROM_STDIN, "exa", *argv]) if env else shlex.join(argv)
        try:
            stdin, stdout, stderr = client.exec_command(command, timeout=timeout_s)
            if env:
                stdin.write("".join(f"{k}={v}\n" for k, v in env.items()))
            stdin.channel.shutdown_write()
            out = stdout.read().decode(errors="replace")
            err = stderr.read().decode(errors="replace")
            code = stdout.channel.recv_exit_status()
        except (OSError, paramiko.SSHException) as exc:
            self._close_sync()
            raise TransportError(f"SSH command on {self.host} failed: {type(exc).__name__}: {exc}") from None
        return CommandResult(argv, code, out, err)

    async def run(self, argv: list[str], *, env: Mapping[str, str] | None = None,
                  timeout_s: float = 60.0) -> CommandResult:
        _check_env(env or {})
        result: CommandResult = await self._call(self._run_sync, argv, dict(env or {}), timeout_s)
        return result

    def _write_sync(self, path: str, text: str, mode: int) -> None:
        sftp = self._sftp_client()
        parent = str(Path(path).parent)
        self._mkdirs(sftp, parent)
        tmp = f"{parent}/.{Path(path).name}.tmp"
        try:
            with sftp.open(tmp, "w") as handle:
                handle.write(text)
            sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, path)
        except OSError as exc:
            raise TransportError(f"cannot write {path} on {self.host}: {exc}") from None

    @staticmethod
    def _mkdirs(sftp: paramiko.SFTPClient, path: str) -> None:
        parts = Path(path).parts
        for i in range(1, len(parts) + 1):
            sub = str(Path(*parts[:i]))
            try:
                sftp.stat(sub)
            except FileNotFoundError:
                sftp.mkdir(sub)

    async def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        await self._call(self._write_sync, path, text, mode)

    def _read_sync(self, path: str) -> str | None:
        sftp = self._sftp_client()
        try:
            with sftp.open(path, "r") as handle:
                data: bytes = handle.read()
        except FileNotFoundError:
            return None
        return data.decode(errors="replace")

    async def read_file(self, path: str) -> str | None:
        text: str | None = await self._call(self._read_sync, path)
        return text

    def _remove_sync(self, path: str) -> bool:
        sftp = self._sftp_client()
        try:
            sftp.remove(path)
        except FileNotFoundError:
            return False
        return True

    async def remove_file(self, path: str) -> bool:
        removed: bool = await self._call(self._remove_sync, path)
        return removed

    async def close(self) -> None:
        await self._call(self._close_sync)
