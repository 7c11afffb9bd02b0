"""The HTTP plumbing of the stub engine servers (recorder, replica_backend, stream_backend): a quiet
HTTP/1.1 handler that writes whole and chunked (server-sent events) answers, and a server on
127.0.0.1 that serves from a daemon thread of the test."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def sse(chunks: Iterable[dict[str, Any]]) -> list[bytes]:
    """The events of an OpenAI stream: one `data:` event a chunk, then `data: [DONE]`."""
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


class _Server(ThreadingHTTPServer):
    """Keeps its open connections, so that closing the stub closes them too (a keep-alive connection
    would otherwise go on being served by its handler thread after the listener is gone)."""

    def __init__(self, address: tuple[str, int], handler: type[StubHandler]) -> None:
        super().__init__(address, handler)
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client that left: quiet
            super().handle_error(request, client_address)


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

    httpd: _Server
    thread: threading.Thread

    def _listen(self, handler: type[StubHandler], port: int, *, in_thread: bool = True) -> None:
        """`in_thread=False`: only bind; the caller runs `self.httpd.serve_forever()` itself."""
        self.httpd = _Server(("127.0.0.1", port), handler)  # daemon_threads: True
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
        """Stop as a stopped server does: new connections are refused and open ones are closed
        (a client holding one sees it end, as it would when the process goes away)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.httpd.lock:
            open_now = list(self.httpd.connections)
        for conn in open_now:
            with contextlib.suppress(OSError):  # already gone
                conn.shutdown(socket.SHUT_RDWR)
