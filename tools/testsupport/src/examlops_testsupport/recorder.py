"""A tiny OpenAI-compatible server that records every body it receives.

Used where a test must see what crossed the wire to the engine (the forwarded media URL, the
structured-output fields an SGLang server gets) — something a real vLLM does not report.

With `to_the_limit=True` it reports usage as a vLLM 0.32 whose model never stops early would: every
choice of every prompt runs to the output bound vLLM obeys for that API, and the prompt counts one
token per word of what vLLM renders as prompt text. Budget tests use it to see what a request
could really cost.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ._http_stub import StubHandler, ThreadedStub, sse

#: vLLM 0.32's rendered-text part types (renderers/chat_utils.py TEXT_PART_TYPES), and their text field.
TEXT_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}
CONTEXT = 8192  # the modelled max_model_len: a chat without an output bound runs to it


def _words(text: Any) -> int:
    return len(text.split()) if isinstance(text, str) else 0


def usage_to_the_limit(path: str, body: dict[str, Any]) -> dict[str, int]:
    """The usage vLLM 0.32 reports when every sequence runs to the bound it obeys."""
    if path.endswith("/completions") and "chat" not in path:
        limit = body.get("max_tokens") or 16  # completions: no max_completion_tokens; null or absent is 16
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        prompt_tokens = sum(len(p) if isinstance(p, list) else _words(p) for p in prompts)
    else:
        mct = body.get("max_completion_tokens")
        limit = mct if mct is not None else body.get("max_tokens") or CONTEXT
        prompts, prompt_tokens = [None], 0
        for m in body.get("messages", []):
            content = m.get("content")
            parts = content if isinstance(content, list) else [content]
            for p in parts:
                if isinstance(p, dict):
                    p = p.get(TEXT_FIELDS.get(str(p.get("type")), ""), "")
                prompt_tokens += _words(p)
    completion = int(limit) * len(prompts) * int(body.get("n") or 1)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


class RecordingServer(ThreadedStub):
    def __init__(self, to_the_limit: bool = False, *, api_key: str = "", port: int = 0) -> None:
        """`api_key`: like `vllm serve` with VLLM_API_KEY, refuse a POST without `Bearer <api_key>`
        (401, recorded in `refused`); `port`: listen there (0: a free port). The answer's text is
        "recorded", or the next of `answers` while it holds any (a test scripts them)."""
        self.bodies: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []  # the HTTP headers of each recorded body
        self.answers: list[str] = []
        self.refused = 0
        self.connections = 0
        recorder = self

        class Handler(StubHandler):
            def setup(self) -> None:
                recorder.connections += 1
                super().setup()

            def do_GET(self) -> None:
                self.send_whole(200, b"{}", "application/json")

            def do_POST(self) -> None:
                body = self.read_json()
                if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                    recorder.refused += 1
                    self.send_whole(401, b'{"error": "Unauthorized"}', "application/json")
                    return
                recorder.bodies.append(body)
                recorder.request_headers.append({k.lower(): v for k, v in self.headers.items()})
                content = recorder.answers.pop(0) if recorder.answers else "recorded"
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                if to_the_limit:
                    usage = usage_to_the_limit(self.path, body)
                if body.get("stream"):
                    chunks = [{"id": "r", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": content},
                                            "finish_reason": "stop"}]},
                              {"id": "r", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                               "choices": [], "usage": usage}]
                    # Chunked like vLLM: the body's terminating chunk comes after [DONE].
                    self.start_stream()
                    for event in sse(chunks):
                        self.write_chunk(event)
                    time.sleep(0.2)
                    self.end_stream()
                    return
                answer = {"id": "r", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                       "finish_reason": "stop"}], "usage": usage}
                self.send_whole(200, json.dumps(answer).encode(), "application/json")

        self._listen(Handler, port)
