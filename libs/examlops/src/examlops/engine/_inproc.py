"""The client side of in-process vLLM: a worker process in the vLLM venv, fed JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from ._render import render_vllm_command
from ._schema import EngineBlock
from ._vllm_check import require_vllm_python

WORKER = Path(__file__).with_name("_inproc_worker.py")


class InprocWorkerError(RuntimeError):
    pass


class InprocWorker:
    """One `vllm.LLM` in a child process; `await generate_batch([...])` scores a batch."""

    def __init__(self, block: EngineBlock, *, model: str | None = None, python: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.block = block
        # The inproc engine loads the same argv a server would get; only the launcher differs.
        server_block = block.model_copy(update={"engine": "vllm-server", "mode": "server"})
        self.command = render_vllm_command(server_block, model=model)
        self.python = python or require_vllm_python()
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **self.command.env, **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None
        self.load_s = 0.0
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            str(self.python), str(WORKER), *self.command.argv, env=self.env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            limit=64 * 1024 * 1024)
        stderr_tail: list[str] = []

        async def drain() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            async for raw in self.proc.stderr:
                stderr_tail.append(raw.decode(errors="replace").rstrip())
                del stderr_tail[:-40]

        self._drain = asyncio.create_task(drain())
        self._stderr_tail = stderr_tail
        hello = await self._read()
        self.load_s = float(hello.get("load_s", 0.0))

    async def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            await self.proc.wait()
            tail = "\n".join(self._stderr_tail[-20:])
            raise InprocWorkerError(f"in-process vLLM exited with {self.proc.returncode}:\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def generate_batch(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        async with self._lock:
            if self.proc is None:
                await self.start()
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"batch": batch}) + "\n").encode())
            await self.proc.stdin.drain()
            answer = await self._read()
        if "error" in answer:
            raise InprocWorkerError(str(answer["error"]))
        results: list[dict[str, Any]] = answer["results"]
        return results

    async def aclose(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._drain.cancel()
        self.proc = None
