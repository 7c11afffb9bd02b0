"""The HTTP plumbing of the stub engine servers (recorder, replica_backend, stream_backend): a quiet
HTTP/1.1 handler that writes whole and chunked (server-sent events) answers, and a server on
127.0.0.1 that serves from a daemon thread of the test."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def sse(chunks: Iterable[dict[str, Any]]) -> list[bytes]:
    """The events of an OpenAI stream: one `data:` event a chunk, then `data: [DONE]`."""
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


class StubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass  # a stub's access log would bury the test's own output

    def read_json(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send_whole(self, status: int, data: bytes, ctype: str | None) -> None:
        """An answer with a Content-Length (and a Content-Type unless `ctype` is None)."""
        self.send_response(status)
        if ctype is not None:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")


class ThreadedStub:
    """A stub server listening on 127.0.0.1:`port` (0: a free port), serving from a daemon thread."""

    httpd: ThreadingHTTPServer
    thread: threading.Thread

    def _listen(self, handler: type[StubHandler], port: int, *, in_thread: bool = True) -> None:
        """`in_thread=False`: only bind; the caller runs `self.httpd.serve_forever()` itself."""
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)  # daemon_threads: True
        if in_thread:
            self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
            self.thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop listening: new connections are refused."""
        self.httpd.shutdown()
        self.httpd.server_close()
