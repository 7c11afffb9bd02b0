"""A tiny OpenAI-compatible server that records every body it receives.

Used where a test must see what crossed the wire to the engine (the forwarded media URL, the
structured-output fields an SGLang server gets) — something a real vLLM does not report.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class RecordingServer:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.connections = 0
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                recorder.connections += 1
                super().setup()

            def do_GET(self) -> None:
                self._send(200, b"{}", "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recorder.bodies.append(body)
                usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                if body.get("stream"):
                    chunks = [{"id": "r", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "recorded"},
                                            "finish_reason": "stop"}]},
                              {"id": "r", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                               "choices": [], "usage": usage}]
                    # Chunked like vLLM: the body's terminating chunk comes after [DONE].
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    events = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
                    for event in events:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        self.wfile.flush()
                    time.sleep(0.2)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                answer = {"id": "r", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": "recorded"},
                                       "finish_reason": "stop"}], "usage": usage}
                self._send(200, json.dumps(answer).encode(), "application/json")

            def _send(self, status: int, data: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
