"""One replica of a pool, for the engine-proxy routing tests: an OpenAI-compatible server in a
thread of the test, whose speed, load and failures the test sets while it runs.

    backend = ReplicaBackend(delay_s=0.3)          # answers each call after 0.3 s
    backend.status = 503                           # ... now every call fails with 503
    backend.cut_after = 2                          # a stream breaks off after 2 chunks
    backend.close(); ReplicaBackend(port=p)        # gone (connection refused), then back

GET /metrics reports `vllm:num_requests_running` as the calls it is answering (plus `running`),
`vllm:num_requests_waiting` as `waiting` and `vllm:kv_cache_usage_perc`, as vLLM does; GET /health
answers 200. `served` counts the calls it answered or refused, `calls` their bodies.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from ._http_stub import StubHandler, ThreadedStub, sse

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


class ReplicaBackend(ThreadedStub):
    def __init__(self, *, delay_s: float = 0.0, port: int = 0, answer: str = "pong") -> None:
        self.delay_s = delay_s        # before the answer (or the stream's first chunk)
        self.chunk_delay_s = 0.05     # between a stream's chunks
        self.chunks = 4               # content chunks of a stream
        self.cut_after = 0            # >0: a stream's connection is dropped after this many chunks
        self.status = 200             # another status: every call is answered with it
        self.running = 0.0            # added to the real in-flight count in /metrics
        self.waiting = 0.0
        self.kv_cache_usage = 0.1
        self.answer = answer
        self.served = 0
        self.in_flight = 0
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        backend = self

        class Handler(StubHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self.send_whole(200, backend.metrics().encode(), "text/plain")
                else:
                    self.send_whole(200, b"", "text/plain")

            def do_POST(self) -> None:
                body = self.read_json()
                with backend.lock:
                    backend.served += 1
                    backend.in_flight += 1
                    backend.calls.append(body)
                try:
                    time.sleep(backend.delay_s)
                    if backend.status != 200:
                        err = {"error": {"message": f"stub says {backend.status}", "type": "stub", "code": None}}
                        self.send_whole(backend.status, json.dumps(err).encode(), "application/json")
                    elif body.get("stream"):
                        self._stream(body)
                    else:
                        self.send_whole(200, json.dumps(backend.whole(body)).encode(), "application/json")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with backend.lock:
                        backend.in_flight -= 1

            def _stream(self, body: dict[str, Any]) -> None:
                self.start_stream()
                for i, event in enumerate(backend.events(body)):
                    if backend.cut_after and i >= backend.cut_after:
                        self.close_connection = True
                        self.connection.shutdown(2)  # dropped mid-answer, as a killed server's socket
                        return
                    self.write_chunk(event)
                    time.sleep(backend.chunk_delay_s)
                self.end_stream()

        self._listen(Handler, port)

    def metrics(self) -> str:
        return (f'vllm:num_requests_running{{model_name="stub"}} {self.in_flight + self.running}\n'
                f'vllm:num_requests_waiting{{model_name="stub"}} {self.waiting}\n'
                f'vllm:kv_cache_usage_perc{{model_name="stub"}} {self.kv_cache_usage}\n')

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"id": "stub", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer},
                             "finish_reason": "stop"}], "usage": USAGE}

    def events(self, body: dict[str, Any]) -> list[bytes]:
        base = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        chunks = [{**base, "choices": [{"index": 0, "delta": {"content": f"{self.answer}{i} "},
                                        "finish_reason": "stop" if i == self.chunks - 1 else None}]}
                  for i in range(self.chunks)]
        chunks.append({**base, "choices": [], "usage": USAGE})
        return sse(chunks)
