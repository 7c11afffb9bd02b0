from __future__ import annotations

from pydantic import Field

from examlops.svc import DEFAULT_PORTS, GrpcServiceSettings


class EngineProxySettings(GrpcServiceSettings):
    """Engine-proxy settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["engine-proxy"], ge=0, le=65535,
                      description="gRPC port of engine-proxy.")
    workers: int = Field(default=1, ge=1, le=64,
                         description="Worker processes, each a whole server on the same port (SO_REUSEPORT); "
                                     "metrics_port is served once, summed over them. Each worker routes "
                                     "with its own in-flight counts and replica scrapes.")
    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}",
                               description="Registry gRPC address; its watch feeds the route table.")
    mediaguard_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['mediaguard']}",
                                 description="Mediaguard gRPC address, called for requests with media.")
    vllm_base_url: str = Field(default="",
                               description="Server for pack models that have no engine.base_url.")
    usecase_dir: str = Field(default="", description="Use-case packs; their models answer without a "
                                                     "registration (EXAMLOPS_USECASE_DIR).")
    connect_timeout_s: float = Field(default=3.0, gt=0, description="Connect timeout to an engine.")
    read_timeout_s: float = Field(default=600.0, gt=0,
                                  description="Longest silence from an engine before the call fails.")
    max_connections_per_endpoint: int = Field(default=256, ge=1,
                                              description="HTTP connection pool size per endpoint.")
    replica_scrape_interval_s: float = Field(
        default=0.5, gt=0, le=1.0,
        description="How often each replica of a pool of two or more is read for its load (/metrics).")
    max_attempts: int = Field(default=3, ge=1, description="Replicas one request may try (never beyond the pool).")
    eject_after_failures: int = Field(
        default=2, ge=1, description="Failed attempts in a row (5xx, timeout, broken read) that eject a replica; "
                                     "a refused or timed-out connect ejects at once.")
    first_byte_timeout_s: float = Field(
        default=0.0, ge=0, description="Longest wait for a replica's first chunk before the attempt moves to "
                                       "another replica (0: only the call's deadline; a non-streamed answer's "
                                       "first chunk is the whole answer).")
