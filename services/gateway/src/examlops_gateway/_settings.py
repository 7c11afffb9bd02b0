from __future__ import annotations

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from examlops.svc import DEFAULT_ADMIN_KEY, DEFAULT_PORTS, MIN_TOKEN_CHARS, ServiceSettings


class GatewaySettings(ServiceSettings):
    """Gateway settings (`EXAMLOPS_*`)."""

    port: int = Field(default=DEFAULT_PORTS["gateway"], ge=0, le=65535, description="HTTP port of the gateway.")
    workers: int = Field(default=1, ge=1, le=64, description="uvicorn worker processes.")
    registry_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['registry']}",
                               description="Registry gRPC address; its watch feeds the route table.")
    engine_proxy_addr: str = Field(default=f"127.0.0.1:{DEFAULT_PORTS['engine-proxy']}",
                                   description="Engine-proxy gRPC address (generation).")
    dev_mode: bool = Field(default=False,
                           description="Development stack (make up, the tests): allows the well-known dev admin key.")
    admin_key: SecretStr = Field(default=SecretStr(DEFAULT_ADMIN_KEY),
                                 description=f"Bearer key with every right; outside dev mode at least "
                                             f"{MIN_TOKEN_CHARS} characters and not the dev key.")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0,
                                description="Largest request body accepted (413 above it).")
    max_prompts: int = Field(default=1024, ge=1,
                             description="Most prompts in one /v1/completions request (vLLM's default "
                                         "VLLM_MAX_COMPLETION_PROMPTS); more is a 400.")
    max_embedding_inputs: int = Field(default=2048, ge=1,
                                      description="Most inputs in one /v1/embeddings request (OpenAI's limit); "
                                                  "more is a 400.")
    request_timeout_s: float = Field(default=600.0, gt=0,
                                     description="Deadline of one generation through engine-proxy.")
    max_messages: int = Field(default=2048, ge=1,
                              description="Most messages in one chat request (400 above it).")
    max_parts_per_message: int = Field(default=256, ge=1,
                                       description="Most content parts in one message (400 above it).")
    structured_retries: int = Field(default=1, ge=0, le=3,
                                    description="Further attempts, each admitted and charged, when a whole answer "
                                                "does not match the request's response_format schema.")
    # --- governance (virtual keys, budgets, rate limits, cost records) -------------------------
    key_check_ttl_s: float = Field(default=2.0, ge=0,
                                   description="How long a virtual key's validity, checked in Redis before its "
                                               "request body is read, is kept in process (reserve.lua still "
                                               "judges every call).")
    key_check_cache_size: int = Field(default=10_000, ge=1,
                                      description="Most valid, and most invalid, keys kept by that check.")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0",
                           description="The registry's Redis, which also holds the gateway's state (virtual keys, "
                                       "budgets, rate limits, cost records) unless EXAMLOPS_GATEWAY_REDIS_URL is set: "
                                       "redis://host:port/db, or redis+cluster://host:port[,host:port...] "
                                       "for a Redis Cluster (rediss:// and rediss+cluster:// with TLS).")
    gateway_redis_url: str = Field(default="",
                                   description="Redis of the gateway's own state (virtual keys, budgets, rate limits, "
                                               "cost records, caches, guardrail policies) when it is not the "
                                               "registry's EXAMLOPS_REDIS_URL (same forms); run it with AOF on "
                                               "(appendfsync everysec: GOVERNANCE.md, Durability). Empty: "
                                               "EXAMLOPS_REDIS_URL.")
    redis_max_connections: int = Field(default=64, ge=1,
                                       description="Redis connections per gateway process (calls wait beyond); "
                                                   "on a Redis Cluster, concurrent commands (each node's pool "
                                                   "holds up to 16 more, for pipelines).")
    guardrail_refresh_s: float = Field(default=0.5, gt=0,
                                       description="How often this replica checks Redis for changed guardrail "
                                                   "policies (one GET of a version counter).")
    cache_refresh_s: float = Field(default=0.5, gt=0,
                                   description="How often this replica checks Redis for changed cache policies "
                                               "(one GET of a version counter) and adds its lookup tallies.")
    cache_max_entries: int = Field(default=100_000, ge=1,
                                   description="Most entries of the semantic cache's index (each replica holds "
                                               "it in memory; the least recently used go first).")
    cache_index_sync_s: float = Field(default=0.25, gt=0,
                                      description="How often this replica's semantic index takes in the entries "
                                                  "other replicas added.")
    cache_embed_timeout_s: float = Field(default=5.0, gt=0,
                                         description="Deadline of the embedding call of a semantic cache lookup "
                                                     "(past it the call goes uncached).")
    price_refresh_s: float = Field(default=60.0, gt=0,
                                   description="How often the price watch is re-opened with a full snapshot (a "
                                               "resync; changes reach the gateway at once on the watch).")
    default_max_tokens: int = Field(default=4096, ge=1,
                                    description="Output bound sent to the engine for budgeted or TPM-limited keys "
                                                "when the client sets no max_tokens.")
    prompt_overhead_tokens: int = Field(default=64, ge=0,
                                        description="Tokens added to the prompt estimate for the chat template.")
    media_part_tokens: int = Field(default=4096, ge=0,
                                   description="Prompt tokens reserved per image/audio/video part.")
    stream_write_timeout_s: float = Field(default=60.0, gt=0,
                                          description="A streamed answer whose client reads nothing this long (a "
                                                      "write held back by its flow control) is ended and its "
                                                      "connection closed; the call is billed what was sent.")
    heartbeat_s: float = Field(default=5.0, gt=0,
                               description="How often this replica tells Redis it is alive.")
    replica_ttl_s: float = Field(default=15.0, gt=0,
                                 description="A replica silent this long is dead; its reservations are reaped.")
    reaper_interval_s: float = Field(default=15.0, gt=0,
                                     description="How often reservations of dead replicas are returned.")
    reservation_grace_s: float = Field(default=60.0, ge=0,
                                       description="A reservation older than request_timeout_s plus this is "
                                                   "reaped even if its replica looks alive.")
    cost_retention_days: float = Field(default=90.0, ge=0,
                                       description="Cost records older than this are trimmed; 0 keeps them all.")
    llm_cost_provider: str = Field(default="prices",
                                   description="How a call's cost is computed: prices (the registry's per-token "
                                               "prices), gpu-hour (the endpoint's GPU-hour price apportioned by "
                                               "the call's share of its server's token throughput) or "
                                               "module:Class (an importable cost provider); GOVERNANCE.md.")
    cost_window_s: int = Field(default=30, ge=1, le=600,
                               description="gpu-hour: the window, in seconds, of a server's recent token "
                                           "throughput.")

    @property
    def store_url(self) -> str:
        """The Redis the gateway keeps its state in: EXAMLOPS_GATEWAY_REDIS_URL, else EXAMLOPS_REDIS_URL."""
        return self.gateway_redis_url or self.redis_url

    @property
    def store_var(self) -> str:
        """The setting store_url came from, which its errors name."""
        return "EXAMLOPS_GATEWAY_REDIS_URL" if self.gateway_redis_url else "EXAMLOPS_REDIS_URL"

    @field_validator("llm_cost_provider")
    @classmethod
    def _cost_provider_resolves(cls, value: str) -> str:
        from .governance._provider import resolve  # the provider is built here, once per process

        resolve(value.strip())  # a ProviderError is a ValueError: the variable is named with the fix
        return value.strip()

    @field_validator("admin_key")
    @classmethod
    def _admin_key_is_a_secret(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        # Anyone who has read the README knows the dev key: it may only open a development stack.
        key = value.get_secret_value()
        if not key:
            raise ValueError("is empty; set a secret (python -c 'import secrets; print(secrets.token_urlsafe(32))')")
        if info.data.get("dev_mode"):
            return value
        if key == DEFAULT_ADMIN_KEY:
            raise ValueError("is unset or the well-known development key, which only a development stack "
                             "(EXAMLOPS_DEV_MODE=1) accepts; set a secret of your own")
        if len(key) < MIN_TOKEN_CHARS:
            raise ValueError(f"is shorter than {MIN_TOKEN_CHARS} characters; outside a development stack "
                             "(EXAMLOPS_DEV_MODE=1) use a longer secret")
        return value

    @model_validator(mode="after")
    def _heartbeat_within_ttl(self) -> GatewaySettings:
        if self.replica_ttl_s <= 2 * self.heartbeat_s:
            raise ValueError(f"EXAMLOPS_REPLICA_TTL_S ({self.replica_ttl_s}) must exceed twice EXAMLOPS_HEARTBEAT_S "
                             f"({self.heartbeat_s}), or live replicas would look dead")
        return self
