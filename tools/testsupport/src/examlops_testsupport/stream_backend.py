"""A slow streaming server that behaves like vLLM 0.32's OpenAI API, as its own process (the chaos
tests SIGKILL it mid-stream).

    python -m examlops_testsupport.stream_backend --port 0 [--tokens-per-chunk 3] [--delay 0.02] [--no-usage]

POST /v1/chat/completions streams `max_tokens` tokens (" w0", " w1", ...; default 200), several per
chunk as vLLM's `--stream-interval` makes them, one chunk every `delay` seconds; with
`stream_options.include_usage` a final usage chunk, and with `continuous_usage_stats` as well the
running usage on every chunk (per choice, as vLLM reports it). A client that goes away aborts the
generation, and `GET /metrics` reports `vllm:num_requests_running` as vLLM does. `--no-usage`
makes a server that reports no usage at all.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

from ._http_stub import StubHandler, ThreadedStub

PROMPT_TOKENS = 7


class StreamBackend(ThreadedStub):
    def __init__(self, port: int, tokens_per_chunk: int, delay: float, usage: bool) -> None:
        self.running = 0
        self.lock = threading.Lock()
        backend = self

        class Handler(StubHandler):
            def do_GET(self) -> None:
                body = (f'vllm:num_requests_running{{model_name="stub"}} {backend.running}\n' if
                        self.path == "/metrics" else "{}").encode()
                self.send_whole(200, body, None)

            def do_POST(self) -> None:
                req = self.read_json()
                opts = req.get("stream_options") or {}
                include = usage and bool(opts.get("include_usage"))
                continuous = include and bool(opts.get("continuous_usage_stats"))
                self.start_stream()
                with backend.lock:
                    backend.running += 1
                try:
                    for event in backend.events(req, tokens_per_chunk, include, continuous):
                        self.write_chunk(event)
                        time.sleep(delay)
                    self.end_stream()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client left: the generation is aborted, as vLLM does
                finally:
                    with backend.lock:
                        backend.running -= 1

        self._listen(Handler, port, in_thread=False)  # main() serves in the foreground

    @staticmethod
    def events(req: dict[str, Any], per_chunk: int, include: bool, continuous: bool) -> Any:
        total = int(req.get("max_completion_tokens") or req.get("max_tokens") or 200)
        base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": req["model"]}

        def usage(done: int) -> dict[str, int]:
            return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": done, "total_tokens": PROMPT_TOKENS + done}

        def event(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]}
        yield event({**first, "usage": usage(0)} if continuous else first)
        done = 0
        while done < total:
            n = min(per_chunk, total - done)
            text = "".join(f" w{done + i}" for i in range(n))
            done += n
            chunk = {**base, "choices": [{"index": 0, "delta": {"content": text},
                                          "finish_reason": "length" if done == total else None}]}
            yield event({**chunk, "usage": usage(done)} if continuous else chunk)
        if include:
            yield event({**base, "choices": [], "usage": usage(done)})
        yield b"data: [DONE]\n\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens-per-chunk", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.02, help="seconds between chunks")
    ap.add_argument("--no-usage", action="store_true", help="never report usage")
    args = ap.parse_args()
    server = StreamBackend(args.port, args.tokens_per_chunk, args.delay, not args.no_usage)
    print(f"ready on {server.port}", flush=True)  # noqa: T201
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
