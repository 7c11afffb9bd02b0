from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from _fixtures import RedisServer, Stack, running_stack, start_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.proc.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack"), redis_server) as s:
        yield s


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
