"""gRPC core settings of every service process; importing this module applies them.

It must be imported before `grpc` is (each service package imports it first): gRPC core reads
`GRPC_EXPERIMENTS` once, when it starts. An operator's own `GRPC_EXPERIMENTS` wins.

gRPC 1.85 runs a Python aio process's sockets on EventEngine threads by default, so every message
crosses three threads (EventEngine thread, completion-queue poller, event loop). With the EventEngine
client, listener and other endpoints turned off, the poller thread does the socket work itself: one
hop fewer. Measured on the request path (gateway and engine-proxy, bench/bench_gateway.py's stack,
one client): about 60 us less CPU per request in each of the two services, and a quarter of the CPU
of a bare unary call.
"""

from __future__ import annotations

import os

EXPERIMENTS_VAR = "GRPC_EXPERIMENTS"
EXPERIMENTS = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"

os.environ.setdefault(EXPERIMENTS_VAR, EXPERIMENTS)
