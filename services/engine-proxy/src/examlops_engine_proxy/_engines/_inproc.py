"""vllm-inproc engine: one `vllm.LLM` in a worker process of the CPU/GPU vLLM environment.

Meant for offline batch scoring (`exa serve llm batch`); online requests work too, answered
whole (a stream is one chunk). The worker is started on first use, so the import of vLLM and
the weight load are paid once, lazily.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from examlops.engine import EngineBlock, InprocWorker, InprocWorkerError
from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._errors import AllBackendsFailed
from ._base import Generation, refuse_embeddings


class InprocEngine:
    name = "vllm-inproc"

    def __init__(self, endpoint: str, block: EngineBlock, served_name: str) -> None:
        self.endpoint = endpoint
        self.served_name = served_name
        self.worker = InprocWorker(block)

    async def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        refuse_embeddings(gen, self.name, self.endpoint)
        body = gen.body
        req: dict[str, Any] = {"id": "0", "max_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
                               "temperature": body.get("temperature", 0.0), "top_p": body.get("top_p", 1.0),
                               "seed": body.get("seed")}
        chat = gen.kind == pb.REQUEST_KIND_CHAT
        if chat:
            req["messages"] = body.get("messages")
        else:
            req["prompt"] = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
        try:
            (res,) = await self.worker.generate_batch([req])
        except InprocWorkerError as exc:
            raise AllBackendsFailed(self.endpoint, str(exc)) from None
        if "error" in res:
            raise AllBackendsFailed(self.endpoint, str(res["error"]))
        usage = {"prompt_tokens": res["prompt_tokens"], "completion_tokens": res["completion_tokens"],
                 "total_tokens": res["prompt_tokens"] + res["completion_tokens"]}
        usage_pb = pb.Usage(prompt_tokens=res["prompt_tokens"], completion_tokens=res["completion_tokens"])
        rid, created = f"inproc-{uuid.uuid4().hex}", int(time.time())
        if chat:
            message = {"role": "assistant", "content": res["text"]}
            choice: dict[str, Any] = {"index": 0, "finish_reason": res["finish_reason"], "logprobs": None,
                                      ("delta" if gen.stream else "message"): message}
        else:
            choice = {"index": 0, "text": res["text"], "finish_reason": res["finish_reason"], "logprobs": None}
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if gen.stream and chat else "")
        obj = {"id": rid, "object": kind, "created": created, "model": self.served_name, "choices": [choice]}
        if not gen.stream:
            yield pb.GenerateChunk(data=orjson.dumps({**obj, "usage": usage}), final=True, usage=usage_pb)
            return
        yield pb.GenerateChunk(data=orjson.dumps(obj), usage=usage_pb)
        tail = orjson.dumps({**obj, "choices": [], "usage": usage}) if gen.want_usage_chunk else b""
        yield pb.GenerateChunk(data=tail, final=True, usage=usage_pb)

    async def aclose(self) -> None:
        await self.worker.aclose()
