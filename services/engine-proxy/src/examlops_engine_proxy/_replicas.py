"""One server of an endpoint's pool as this proxy sees it: its engine, its live load, its health.

Load comes from the server's own `/metrics`, read in the background (never on the request path)
every EXAMLOPS_REPLICA_SCRAPE_INTERVAL_S, plus the requests this proxy has in flight on it. The
router treats metrics older than STALE_AFTER_S as saturated.

Passive health: a failed attempt counts against the replica. A refused or timed-out connect means
nothing answers there, so it ejects at once; a 5xx, a timeout or a broken read may be transient,
so it takes EXAMLOPS_EJECT_AFTER_FAILURES in a row. An ejected replica gets no new picks; at the
end of its back-off (1 s, doubling to EJECT_MAX_S, so a restarted server is back within seconds)
a GET /health brings it back, and a failed probe doubles the back-off. A successful request
resets everything.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from examlops.svc import multiprocess_enabled

from ._engines import Engine, VllmServerEngine
from ._engines._vllm_server import NET_ERRORS, net_failure
from ._spec_decode import SPEC_COUNTERS, SpecCounters

log = logging.getLogger(__name__)

EJECT_BASE_S = 1.0
EJECT_MAX_S = 4.0
SCRAPE_TIMEOUT_S = 1.0
PROBE_TIMEOUT_S = 1.0

_LABELS = ["endpoint", "replica"]
REQUESTS = Counter("examlops_engine_replica_requests", "Attempts sent to a replica.", _LABELS)
ERRORS = Counter("examlops_engine_replica_errors", "Attempts that failed on a replica (connect, timeout, 5xx).",
                 _LABELS)
EJECTIONS = Counter("examlops_engine_replica_ejections", "Times a replica was ejected by passive health.", _LABELS)
RETRIES = Counter("examlops_engine_replica_retries", "Attempts that moved from a replica to another.", _LABELS)
PICKS = Counter("examlops_engine_replica_picks", "Routing decisions by reason.", [*_LABELS, "reason"])
# With several workers (EXAMLOPS_WORKERS) each scrapes the same server: its latest reading is the
# value; the requests in flight are the sum over the workers.
RUNNING = Gauge("examlops_engine_replica_requests_running", "Scraped vllm:num_requests_running.", _LABELS,
                multiprocess_mode="livemostrecent")
WAITING = Gauge("examlops_engine_replica_requests_waiting", "Scraped vllm:num_requests_waiting.", _LABELS,
                multiprocess_mode="livemostrecent")
KV_CACHE = Gauge("examlops_engine_replica_kv_cache_usage", "Scraped vllm:kv_cache_usage_perc (0..1).", _LABELS,
                 multiprocess_mode="livemostrecent")
IN_FLIGHT = Gauge("examlops_engine_replica_in_flight", "Requests this proxy has on the replica now.", _LABELS,
                  multiprocess_mode="livesum")
_GAUGES = (RUNNING, WAITING, KV_CACHE, IN_FLIGHT)

#: The load lines of a vLLM (or SGLang) /metrics page, and vLLM's speculative-decoding counters;
#: one regex pass, no full Prometheus parse.
_LOAD_LINE = re.compile(
    rb"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc"
    rb"|sglang:num_running_reqs|sglang:num_queue_reqs|sglang:token_usage"
    rb"|vllm:spec_decode_num_drafts_total|vllm:spec_decode_num_draft_tokens_total"
    rb"|vllm:spec_decode_num_accepted_tokens_total)(?:\{[^}\n]*\})?[ \t]+(\S+)", re.M)
_FIELD = {b"vllm:num_requests_running": 0, b"sglang:num_running_reqs": 0,
          b"vllm:num_requests_waiting": 1, b"sglang:num_queue_reqs": 1,
          b"vllm:kv_cache_usage_perc": 2, b"vllm:gpu_cache_usage_perc": 2, b"sglang:token_usage": 2,
          **{name: 3 + i for i, name in enumerate(SPEC_COUNTERS)}}


def parse_metrics(page: bytes) -> tuple[tuple[float, float, float] | None, SpecCounters | None]:
    """(running, waiting, kv_cache_usage) of a /metrics page, summed over label sets (the cache
    usage is the fullest one's), and its speculative-decoding counters (summed); each None when
    the page has none of them."""
    values = [0.0] * 6
    seen_load = seen_spec = False
    for match in _LOAD_LINE.finditer(page):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        i = _FIELD[match.group(1)]
        values[i] = max(values[i], value) if i == 2 else values[i] + value
        if i < 3:
            seen_load = True
        else:
            seen_spec = True
    return ((values[0], values[1], values[2]) if seen_load else None,
            SpecCounters(values[3], values[4], values[5]) if seen_spec else None)


def parse_load(page: bytes) -> tuple[float, float, float] | None:
    """(running, waiting, kv_cache_usage) of a /metrics page (parse_metrics)."""
    return parse_metrics(page)[0]


@dataclass(eq=False, slots=True)
class Replica:
    """A Candidate for the router (id, in_flight, running, waiting, kv_cache_usage, metrics_at)."""

    endpoint: str
    id: str
    base_url: str
    engine: Engine
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    metrics_at: float = 0.0          # time.monotonic() of the last good scrape; 0.0 never
    spec: SpecCounters | None = None  # the last scrape's speculative-decoding counters
    scraped: bool = False            # a scrape answered 200 (spec None then: the server has no such counters)
    draining: bool = False
    failures: int = 0                # in a row
    ejected_until: float = 0.0       # monotonic; 0.0 healthy
    backoff_s: float = 0.0
    requests: int = 0
    errors: int = 0
    ejections: int = 0
    retries: int = 0
    picks: dict[str, int] = field(default_factory=dict)
    last_error: str = ""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    _requests: Counter = field(init=False)
    _in_flight: Gauge = field(init=False)

    def __post_init__(self) -> None:
        self._requests = REQUESTS.labels(self.endpoint, self.id)
        self._in_flight = IN_FLIGHT.labels(self.endpoint, self.id)
        self.idle.set()

    @property
    def ejected(self) -> bool:
        return self.ejected_until > 0.0

    def start(self, reason: str) -> None:
        """An attempt begins on this replica, picked for `reason`."""
        self.in_flight += 1
        self.requests += 1
        self.picks[reason] = self.picks.get(reason, 0) + 1
        self.idle.clear()
        self._requests.inc()
        self._in_flight.inc()
        PICKS.labels(self.endpoint, self.id, reason).inc()

    def finish(self) -> None:
        self.in_flight -= 1
        self._in_flight.dec()
        if self.in_flight == 0:
            self.idle.set()

    def succeeded(self) -> None:
        if self.failures or self.ejected_until or self.backoff_s:
            if self.ejected:
                log.info("replica %s of endpoint %r answered again; back in the pool", self.id, self.endpoint)
            self.failures, self.ejected_until, self.backoff_s = 0, 0.0, 0.0

    def failed(self, kind: str, detail: str, eject_after: int) -> None:
        """A failed attempt (not a refusal of the request): maybe eject."""
        self.errors += 1
        self.failures += 1
        self.last_error = detail
        ERRORS.labels(self.endpoint, self.id).inc()
        if not self.ejected and (kind == "connect" or self.failures >= eject_after):
            self.eject(detail)

    def moved(self) -> None:
        """The request moved on to another replica after failing here."""
        self.retries += 1
        RETRIES.labels(self.endpoint, self.id).inc()

    def eject(self, why: str) -> None:
        self.backoff_s = EJECT_BASE_S if not self.backoff_s else min(self.backoff_s * 2, EJECT_MAX_S)
        self.ejected_until = time.monotonic() + self.backoff_s
        self.ejections += 1
        EJECTIONS.labels(self.endpoint, self.id).inc()
        log.warning("replica %s of endpoint %r ejected for %.0f s after %d failure(s): %s",
                    self.id, self.endpoint, self.backoff_s, self.failures, why)

    def set_load(self, load: tuple[float, float, float]) -> None:
        self.running, self.waiting, self.kv_cache_usage = load
        self.metrics_at = time.monotonic()
        RUNNING.labels(self.endpoint, self.id).set(load[0])
        WAITING.labels(self.endpoint, self.id).set(load[1])
        KV_CACHE.labels(self.endpoint, self.id).set(load[2])

    def forget_series(self) -> None:
        """Drop this replica's gauges (it left the pool); its counters stay, as counters do."""
        for gauge in _GAUGES:
            if multiprocess_enabled():  # a series in the workers' shared files cannot be removed: zeroed
                gauge.labels(self.endpoint, self.id).set(0)
                continue
            try:
                gauge.remove(self.endpoint, self.id)
            except KeyError:
                pass


async def _probe(engine: VllmServerEngine) -> str:
    """'' when GET /health answers 200, else why not."""
    try:
        status, _ = await engine.get("/health", PROBE_TIMEOUT_S)
    except NET_ERRORS as exc:
        return net_failure(exc)[1]
    return "" if status == 200 else f"/health answered {status}"


async def scrape(replica: Replica, timeout_s: float = SCRAPE_TIMEOUT_S) -> SpecCounters | None:
    """Read the replica's load and speculative-decoding counters (the latter returned); a failed
    scrape only lets its metrics go stale."""
    engine = replica.engine
    assert isinstance(engine, VllmServerEngine)
    try:
        status, page = await engine.get("/metrics", timeout_s)
    except NET_ERRORS as exc:
        log.debug("scrape of %s failed: %s", replica.base_url, net_failure(exc)[1])
        return None
    if status != 200:
        return None
    load, spec = parse_metrics(page)
    if load is not None:
        replica.set_load(load)
    replica.spec, replica.scraped = spec, True
    return spec


async def watch_replica(replica: Replica, interval_s: float, scrapes: bool) -> None:
    """The replica's background life: scrape its load (pools of two or more) and its speculative-
    decoding counters (endpoints with speculative decoding), probe it back when its ejection ends.
    Runs until cancelled (the replica left the pool)."""
    engine = replica.engine
    assert isinstance(engine, VllmServerEngine)
    while True:
        started = time.monotonic()
        if replica.ejected and started >= replica.ejected_until:
            why = await _probe(engine)
            if not why:
                log.info("replica %s of endpoint %r answered /health; back in the pool", replica.id, replica.endpoint)
                replica.failures, replica.ejected_until = 0, 0.0
            else:
                replica.last_error = why
                replica.backoff_s = min(replica.backoff_s * 2, EJECT_MAX_S) or EJECT_BASE_S
                replica.ejected_until = time.monotonic() + replica.backoff_s
        if scrapes:
            await scrape(replica)
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
