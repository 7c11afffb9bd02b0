"""One Redis client factory for the services: a single Redis or a Redis Cluster, from one URL.

`EXAMLOPS_REDIS_URL` takes either form:
  redis://[user:password@]host:port[/db]              one Redis (rediss:// with TLS, unix:///path.sock)
  redis+cluster://[user:password@]host:port[,host:port...][/][?option=value...]
                                                      a Redis Cluster, found from any of the seed nodes
                                                      (rediss+cluster:// with TLS; no database: a
                                                      cluster has only db 0)
Query options are redis-py's URL options (socket_timeout, ssl_cert_reqs, ...). Every key the services
use carries a hash tag ({exa:reg}, {exa:gw}, {vk:<id>}), so each multi-key command, Lua script and
MULTI/EXEC stays in one slot and runs unchanged on a cluster.

A cluster has no BlockingConnectionPool (its per-node pools raise when full): with `max_connections`
the cluster client makes commands wait for one of that many slots instead, as the single-Redis pool
does, and each node's pool gets room for pipelines beyond them.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.exceptions import CrossSlotTransactionError, RedisClusterException, RedisError

from examlops.urlmask import redact

REDIS_URL_VAR = "EXAMLOPS_REDIS_URL"
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SINGLE_SCHEMES = ("redis", "rediss", "unix")
#: Connections each cluster node may open beyond `max_connections` (pipelines, fan-out commands).
PIPELINE_HEADROOM = 16
UNBOUNDED = 2**31


class RedisUrlError(ValueError):
    """A Redis URL setting cannot be used (the message names the variable and the accepted forms)."""


class RedisUnavailable(RuntimeError):
    """Redis (or the cluster) does not answer, or is not what the URL says (message without password)."""


def _url_error(url: str, problem: str, var: str = REDIS_URL_VAR) -> RedisUrlError:
    return RedisUrlError(
        f"{var}: {problem} (got {redact(url)!r}); use redis://host:port/db, rediss://..., "
        "unix:///path.sock, or redis+cluster://[user:password@]host:port[,host:port...] "
        "(rediss+cluster:// with TLS)")


def _cluster_seeds(url: str, var: str = REDIS_URL_VAR) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """(seed nodes, connection options) of a redis+cluster:// URL; RedisUrlError when malformed."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for host in hosts.split(","):
        one = urlsplit("//" + host.strip())
        try:
            port = one.port or 6379
        except ValueError:
            raise _url_error(url, f"the seed {host!r} has no valid port", var) from None
        if not one.hostname:
            raise _url_error(url, f"a seed node is empty ({hosts!r})", var)
        seeds.append((one.hostname, port))
    base = CLUSTER_SCHEMES[parts.scheme]
    host, port = seeds[0]
    netloc = f"{userinfo}@" if userinfo else ""
    netloc += f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        options: dict[str, Any] = dict(parse_url(f"{base}://{netloc}{parts.path}?{parts.query}"))
    except ValueError as exc:
        raise _url_error(url, str(exc), var) from None
    if options.pop("db", 0):
        raise _url_error(url, "a Redis Cluster has only database 0", var)
    options.pop("host", None)
    options.pop("port", None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    return seeds, options


def check_redis_url(url: str, var: str = REDIS_URL_VAR) -> str:
    """`url` if it is a Redis or Redis Cluster URL these services accept, else RedisUrlError (a settings
    validator: `load_settings` then names EXAMLOPS_REDIS_URL and exits 2)."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        _cluster_seeds(url, var)
    elif scheme in SINGLE_SCHEMES:
        try:
            parse_url(url)
        except ValueError as exc:
            raise _url_error(url, str(exc), var) from None
    else:
        raise _url_error(url, f"unknown scheme {scheme + '://' if scheme else '(none)'}", var)
    return url


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


class _Cluster(RedisCluster):
    """A RedisCluster that says "no node answers" with a ConnectionError, a RedisError like a single
    Redis's: the services' loops (heartbeat, reaper, policy refresh) catch those and carry on, while
    redis-py's RedisClusterException would end them."""

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        try:
            return await super().initialize(*args, **kwargs)
        except CrossSlotTransactionError:
            raise
        except RedisClusterException as exc:
            raise aioredis.ConnectionError(f"Redis Cluster unreachable: {exc}") from exc


class _WaitingCluster(_Cluster):
    """A RedisCluster whose commands wait (up to `wait_s`) for one of `limit` slots rather than fail
    with MaxConnectionsError when a node's pool is full: BlockingConnectionPool's behaviour."""

    def __init__(self, *, limit: int, wait_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._slots = asyncio.Semaphore(limit)
        self._wait_s = wait_s

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._slots.acquire()
        except TimeoutError:
            raise aioredis.ConnectionError(f"no free Redis Cluster connection within {self._wait_s:g} s") from None
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self._slots.release()


def redis_client(url: str, *, max_connections: int | None = None, wait_s: float = 10.0,
                 retry: Retry | None = None, retry_on: tuple[type[Exception], ...] = (),
                 socket_timeout: float | None = None, connect_timeout: float | None = None,
                 health_check_interval: float = 0, decode_responses: bool = True,
                 var: str = REDIS_URL_VAR) -> aioredis.Redis:
    """The client of `url` (see the module doc): a redis.asyncio.Redis, or a RedisCluster for
    redis+cluster:// URLs, which speaks the same commands; typed as Redis so the stores take either.

    `max_connections`: None opens connections as needed; a number bounds them and makes calls wait
    up to `wait_s` for a free one. `socket_timeout` None lets blocking reads (XREAD BLOCK) wait.
    `var`: the setting the URL came from, which errors name.
    """
    check_redis_url(url, var)
    common: dict[str, Any] = {
        "decode_responses": decode_responses, "health_check_interval": health_check_interval,
        "socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout}
    if not is_cluster_url(url):
        if retry is not None:
            common.update(retry=retry, retry_on_error=list(retry_on))
        if max_connections is None:
            return aioredis.Redis.from_url(url, **common)
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=wait_s,
                                                        **common)
        return aioredis.Redis.from_pool(pool)
    seeds, options = _cluster_seeds(url, var)
    kwargs: dict[str, Any] = {
        **common, **options, "startup_nodes": [ClusterNode(h, p) for h, p in seeds],
        # every node and slot the cluster reports replaces the seeds (a seed may leave the cluster)
        "dynamic_startup_nodes": True,
        "max_connections": UNBOUNDED if max_connections is None else max_connections + PIPELINE_HEADROOM}
    if retry is not None:
        kwargs["retry"] = retry
    try:
        if max_connections is None:
            cluster: RedisCluster = _Cluster(**kwargs)
        else:
            cluster = _WaitingCluster(limit=max_connections, wait_s=wait_s, **kwargs)
    except (TypeError, RedisClusterException) as exc:
        raise _url_error(url, str(exc), var) from None
    # RedisCluster is no Redis subclass but answers every command the services send (see the module doc)
    return cast(aioredis.Redis, cluster)


def redis_primaries(client: aioredis.Redis) -> list[Any]:
    """The cluster's primary nodes (each a `target_nodes=` value), or [] for a single Redis."""
    return list(client.get_primaries()) if isinstance(client, RedisCluster) else []


async def ping_redis(client: aioredis.Redis, url: str, var: str = REDIS_URL_VAR) -> None:
    """Start-up check: Redis answers, and the URL's form matches the server's (a cluster node behind
    redis:// would answer every key elsewhere with MOVED). RedisUnavailable, naming the variable."""
    try:
        if isinstance(client, RedisCluster):
            await client.initialize()
            await client.ping(target_nodes=RedisCluster.PRIMARIES)
            return
        await client.ping()
        info = await client.info("cluster")
    except (RedisError, RedisClusterException, OSError) as exc:
        raise RedisUnavailable(redact(f"cannot reach Redis at {var}={url}: {exc}")) from None
    if int(info.get("cluster_enabled", 0)):
        raise RedisUnavailable(redact(
            f"{var}={url} is a node of a Redis Cluster: use redis+cluster://host:port[,host:port...]"))


async def ping_all(client: aioredis.Redis) -> bool:
    """Readiness: the single Redis, or every primary of the cluster, answers a PING."""
    if isinstance(client, RedisCluster):
        return bool(await client.ping(target_nodes=RedisCluster.PRIMARIES))
    return bool(await client.ping())
