from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from .._errors import EngineRejected

#: The engine server's OpenAI path for each request kind.
PATHS: dict[int, str] = {
    pb.REQUEST_KIND_CHAT: "/v1/chat/completions",
    pb.REQUEST_KIND_COMPLETION: "/v1/completions",
    pb.REQUEST_KIND_EMBEDDINGS: "/v1/embeddings",
}


@dataclass(slots=True)
class Generation:
    """One request as an engine sees it."""

    kind: int                      # pb.RequestKind
    body: dict[str, Any]           # the OpenAI request; "model" already the served name
    stream: bool
    want_usage_chunk: bool         # the client asked for stream_options.include_usage
    want_usage_stats: bool         # ... and for continuous_usage_stats (usage on every chunk)
    endpoint: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return PATHS.get(self.kind, "/v1/completions")

    @property
    def embeddings(self) -> bool:
        """An embeddings call: answered whole, in one final chunk, with no completion tokens."""
        return self.kind == pb.REQUEST_KIND_EMBEDDINGS


def refuse_embeddings(gen: Generation, engine: str, endpoint: str) -> None:
    """Raise EngineRejected for an embeddings call to an engine that cannot serve one."""
    if gen.embeddings:
        raise EngineRejected(f"endpoint:{endpoint}: engine {engine!r} does not serve embeddings "
                             "(an embedding endpoint runs engine vllm-server or echo with task: embed)",
                             "model")


class Engine(Protocol):
    name: str

    def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        """Yield chunks; the last has final=True and the usage when the engine reported it. A stream's
        chunks carry the usage delivered so far (what a cut stream is billed) when the engine reports it."""
        ...

    async def aclose(self) -> None:
        ...
