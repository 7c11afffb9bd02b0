"""The client side of in-process vLLM: a worker process in the vLLM venv, fed JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import re
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
        self.env = {**os.environ, **self.command.env, **(env or {})}
        # CPU builds size their KV cache from this (GPU builds ignore it); without it the CPU
        # worker reserves a fraction of the whole node's memory and refuses to start beside others.
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if model is not None and Path(model).is_dir():
            self.env.setdefault("HF_HUB_OFFLINE", "1")  # local weights: nothing to fetch
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
                del stderr_tail[:-400]

        self._drain = asyncio.create_task(drain())
        self._stderr_tail = stderr_tail
        hello = await self._read()
        self.load_s = float(hello.get("load_s", 0.0))

    async def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            await self.proc.wait()
            await asyncio.sleep(0.1)  # let the stderr reader take the last lines
            raise InprocWorkerError(f"in-process vLLM exited with {self.proc.returncode}: {self._root_cause()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _root_cause(self) -> str:
        """vLLM's workers log the real error long before the last traceback: name it first."""
        causes = [line.split("] ", 1)[-1] for line in self._stderr_tail if re.search(r"\b\w+Error: ", line)]
        last = "\n".join(self._stderr_tail[-8:])
        return (causes[0] + "\n" if causes else "") + last

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
