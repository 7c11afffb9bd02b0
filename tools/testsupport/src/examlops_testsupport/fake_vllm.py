"""`vllm serve <model> --port P ...` stand-in for launcher tests that need a server but no model.

It answers /health, /v1/models and /metrics (with vLLM's metric names), and records in
`$EXAMLOPS_FAKE_VLLM_RECORD` (when set) its argv and whether VLLM_API_KEY reached it — never
the key's value. Like vLLM, with VLLM_API_KEY set it answers /v1/* only to `Bearer <that key>`.
The real-vLLM tier runs the real `vllm serve` through the same job scripts.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="fake"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="fake"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="fake"} 0.25
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="fake"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="fake"} 4.0
vllm:time_to_first_token_seconds_count{model_name="fake"} 4.0
vllm:time_to_first_token_seconds_sum{model_name="fake"} 0.8
"""


def main(argv: list[str]) -> None:
    assert argv[0] == "serve", argv
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    api_key = os.environ.get("VLLM_API_KEY")
    record = os.environ.get("EXAMLOPS_FAKE_VLLM_RECORD")
    if record:
        with open(record, "w") as handle:
            json.dump({"argv": argv, "api_key_present": bool(os.environ.get("VLLM_API_KEY"))}, handle)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if api_key and self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {api_key}":
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body, kind = {"/health": (b"", "text/plain"), "/metrics": (METRICS.encode(), "text/plain"),
                          "/v1/models": (b'{"object":"list","data":[]}', "application/json")
                          }.get(self.path, (None, ""))
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
