"""sglang engine: a client of an SGLang server's OpenAI-compatible API.

SGLang takes structured-output constraints as top-level request fields (`json_schema`, `regex`,
`ebnf`) besides OpenAI's `response_format`. Callers that speak vLLM's dialect (`guided_json`,
`guided_regex`, `guided_grammar`, or `structured_outputs: {json, regex, grammar}`) are translated,
so one request works against either engine; SGLang-native fields pass through untouched.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ._base import Generation, refuse_embeddings
from ._vllm_server import VllmServerEngine

#: vLLM spelling -> SGLang spelling
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf"}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "ebnf"}


def to_sglang_body(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    structured = out.pop("structured_outputs", None)
    pairs = [(_GUIDED[k], out.pop(k)) for k in list(out) if k in _GUIDED]
    if isinstance(structured, dict):
        pairs += [(_STRUCTURED[k], v) for k, v in structured.items() if k in _STRUCTURED]
    for key, value in pairs:
        if key == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)  # SGLang wants the schema as a JSON string
        out.setdefault(key, value)
    return out


class SglangEngine(VllmServerEngine):
    name = "sglang"

    def prepare(self, gen: Generation) -> dict[str, Any]:
        return to_sglang_body(super().prepare(gen))

    async def generate(self, gen: Generation) -> AsyncIterator[pb.GenerateChunk]:
        refuse_embeddings(gen, self.name, self.endpoint)
        async for chunk in super().generate(gen):
            yield chunk
