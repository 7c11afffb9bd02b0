"""The governance scripts' pipelined connection (governance/_pipe.py) on real Redis servers: the same
replies as redis-py's client, every reply to its own caller under concurrency and cancellation, a
script Redis lost, a restarted Redis, a Redis that hangs, the URL's password and database."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import uvloop
from redis.commands.core import AsyncScript

from examlops_devstack import Proc, spawn
from examlops_gateway.governance import ScriptPipe, pipe_for
from examlops_gateway.governance._pipe import PipedScript, scripts_for
from examlops_testsupport.fixtures import RedisServer, free_port, start_redis

ECHO = "return {ARGV[1], tonumber(ARGV[2]), {KEYS[1], #ARGV}, redis.call('INCR', KEYS[1])}"
FAILS = "return redis.error_reply('BROKEN ' .. ARGV[1])"


def _piped(pipe: ScriptPipe, source: str) -> PipedScript:
    return PipedScript(pipe, source)


def test_replies_match_redis_py_and_errors_raise_response_error(redis_server: RedisServer) -> None:
    async def run() -> None:
        client = aioredis.Redis(port=redis_server.port, decode_responses=True)
        pipe = ScriptPipe(redis_server.url)
        try:
            theirs = await client.register_script(ECHO)(keys=["pipe:a"], args=["héllo", 12.34, 7])
            ours = await _piped(pipe, ECHO)(keys=["pipe:a"], args=["héllo", 12.34, 7])
            assert ours[:3] == theirs[:3] == ["héllo", 12, ["pipe:a", 3]] and ours[3] == theirs[3] + 1
            with pytest.raises(redis.ResponseError, match="BROKEN x"):
                await _piped(pipe, FAILS)(keys=["pipe:a"], args=["x"])
            with pytest.raises(redis.DataError, match="bool"):
                await _piped(pipe, ECHO)(keys=["pipe:a"], args=[True, 1])
            assert await _piped(pipe, ECHO)(keys=["pipe:b"], args=["after", 1]) == ["after", 1, ["pipe:b", 2], 1]
        finally:
            await pipe.close()
            await client.aclose()

    uvloop.run(run())


def test_concurrent_and_cancelled_calls_each_get_their_own_reply(redis_server: RedisServer) -> None:
    slow = "local t = redis.call('TIME'); while true do local n = redis.call('TIME'); " \
           "if (n[1] - t[1]) * 1000000 + n[2] - t[2] > 20000 then break end end; return ARGV[1]"

    async def run() -> None:
        pipe = ScriptPipe(redis_server.url)
        echo, wait = _piped(pipe, "return ARGV[1]"), _piped(pipe, slow)
        try:
            replies = await asyncio.gather(*(echo(keys=["pipe:c"], args=[f"call-{i}"]) for i in range(500)))
            assert replies == [f"call-{i}" for i in range(500)]
            # a caller that gives up while its reply is on the way leaves the order intact
            doomed = asyncio.create_task(wait(keys=["pipe:c"], args=["doomed"]))
            after = asyncio.create_task(echo(keys=["pipe:c"], args=["after"]))
            await asyncio.sleep(0.005)
            doomed.cancel()
            assert await after == "after"
            assert await echo(keys=["pipe:c"], args=["next"]) == "next"
        finally:
            await pipe.close()

    uvloop.run(run())


def test_a_script_redis_lost_is_sent_again_whole(redis_server: RedisServer) -> None:
    async def run() -> None:
        pipe = ScriptPipe(redis_server.url)
        script = _piped(pipe, "return 'fresh ' .. ARGV[1]")
        try:
            assert await script(keys=["pipe:d"], args=["1"]) == "fresh 1"
            redis_server.client().script_flush()
            assert await script(keys=["pipe:d"], args=["2"]) == "fresh 2"  # NOSCRIPT, then EVAL
            assert redis_server.client().script_exists(script.sha) == [True]
        finally:
            await pipe.close()

    uvloop.run(run())


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own, to kill, restart or stop."""
    server = start_redis(tmp_path / "r", fsync="everysec")
    try:
        yield server
    finally:
        server.proc.stop()


def test_a_restarted_redis_is_reached_again_and_calls_in_flight_are_retried(tmp_path: Path,
                                                                            own_redis: RedisServer) -> None:
    server = own_redis

    async def run() -> None:
        pipe = ScriptPipe(server.url)
        incr = _piped(pipe, "return redis.call('INCR', KEYS[1])")
        try:
            assert await incr(keys=["pipe:n"], args=[]) == 1
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.popen.wait(5)
            calls = [asyncio.create_task(incr(keys=["pipe:n"], args=[])) for _ in range(20)]
            await asyncio.sleep(0.05)  # the calls fail over to retries while Redis is down
            restarted = await asyncio.to_thread(start_redis, tmp_path / "r", server.port, "everysec")
            try:
                done = await asyncio.gather(*calls, return_exceptions=True)
                landed = [d for d in done if isinstance(d, int)]
                failed = [d for d in done if not isinstance(d, int)]
                assert all(isinstance(f, redis.ConnectionError) for f in failed), failed
                assert len(landed) + len(failed) == 20
                assert await incr(keys=["pipe:n"], args=[]) == max(landed, default=1) + 1
            finally:
                restarted.proc.stop()
        finally:
            await pipe.close()

    uvloop.run(run())


def test_a_redis_that_hangs_fails_the_call_within_the_timeout_then_it_recovers(own_redis: RedisServer) -> None:
    server = own_redis

    async def run() -> None:
        pipe = ScriptPipe(server.url, timeout_s=0.5)
        echo = _piped(pipe, "return ARGV[1]")
        try:
            assert await echo(keys=["pipe:h"], args=["up"]) == "up"
            os.kill(server.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            try:
                with pytest.raises(redis.TimeoutError, match=r"did not answer within 0\.5 s"):
                    await echo(keys=["pipe:h"], args=["hung"])
                assert time.monotonic() - started < 3
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            assert await echo(keys=["pipe:h"], args=["back"]) == "back"
        finally:
            await pipe.close()

    uvloop.run(run())


def test_the_urls_password_and_database_are_used_and_a_wrong_password_is_named(tmp_path: Path) -> None:
    port = free_port()
    proc: Proc = spawn("redis-auth", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--requirepass", "s3cret"], {}, tmp_path / "redis.log")
    try:
        sync = redis.Redis(port=port, password="s3cret", db=3, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                sync.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)

        async def run() -> None:
            pipe = ScriptPipe(f"redis://:s3cret@127.0.0.1:{port}/3")
            wrong = ScriptPipe(f"redis://:nope@127.0.0.1:{port}/3")
            try:
                await _piped(pipe, "return redis.call('SET', KEYS[1], ARGV[1])")(keys=["pipe:db"], args=["three"])
                clients = len(sync.client_list())
                started = time.monotonic()
                with pytest.raises(redis.AuthenticationError, match="refused the URL's credentials"):
                    await _piped(wrong, "return 1")(keys=["pipe:db"], args=[])
                assert time.monotonic() - started < 0.2  # not tried again (the retries back off 0.28 s)
                await asyncio.sleep(0.05)
                assert len(sync.client_list()) == clients  # the refused connection is closed
            finally:
                await pipe.close()
                await wrong.close()

        uvloop.run(run())
        assert sync.get("pipe:db") == "three"
        assert redis.Redis(port=port, password="s3cret", db=0).get("pipe:db") is None
    finally:
        proc.stop()


def test_a_cluster_or_tls_url_keeps_redis_py(redis_server: RedisServer) -> None:
    assert pipe_for("redis+cluster://127.0.0.1:7000") is None
    assert pipe_for("rediss://127.0.0.1:6380/0") is None
    pipe = pipe_for(redis_server.url)
    assert isinstance(pipe, ScriptPipe)
    client = aioredis.Redis(port=redis_server.port, decode_responses=True)
    assert isinstance(scripts_for(pipe, client, "settle.lua"), PipedScript)
    assert isinstance(scripts_for(None, client, "settle.lua"), AsyncScript)


def test_close_during_a_connect_fails_the_waiting_call_with_connection_error(own_redis: RedisServer) -> None:
    async def run() -> None:
        pipe = ScriptPipe(own_redis.url.removesuffix("/0") + "/1")  # SELECT 1: a handshake to wait on
        os.kill(own_redis.proc.pid, signal.SIGSTOP)  # the kernel accepts; Redis answers nothing
        try:
            call = asyncio.create_task(_piped(pipe, "return 1")(keys=["pipe:x"], args=[]))
            await asyncio.sleep(0.1)
            await pipe.close()
            with pytest.raises(redis.ConnectionError, match="shutting down"):
                await call
        finally:
            os.kill(own_redis.proc.pid, signal.SIGCONT)

    uvloop.run(run())
