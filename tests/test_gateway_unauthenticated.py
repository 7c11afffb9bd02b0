"""Work a caller can cause before it is known is bounded.

A well-formed but unknown virtual key is refused before its body is read (the gateway answers 401
while the client is still sending it); a body holds a bounded number of messages and parts; a large
body is still served (it is parsed off the event loop).
"""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, wait_until

ADMIN = {"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"}
MODEL = "unauth-echo"


@pytest.fixture(scope="module")
def gw(stack: Stack) -> Iterator[Stack]:
    stack.register(MODEL, engine="echo")
    wait_until(lambda: any(m["id"] == MODEL for m in httpx.get(stack.gateway_url + "/v1/models",
                                                                headers=ADMIN).json()["data"]), 10)
    yield stack


def fake_key() -> str:
    return f"sk-exa-{secrets.token_hex(6)}-{secrets.token_urlsafe(32)}"


def head_then_stall(url: str, key: str, declared: int, sent: bytes) -> tuple[int, dict[str, object]]:
    """POST a chat body of `declared` bytes but send only `sent` of it, then wait for an answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode()
        sock.sendall(head + sent)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)  # times out (the test fails) if the gateway waits for the body
            if not chunk:
                break
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def test_unknown_key_is_refused_before_its_body_is_read(gw: Stack) -> None:
    start = b'{"model": "' + MODEL.encode() + b'", "messages": [' + b'{"role": "user", "content": "x"}, ' * 2000
    declared = 15 * 1024 * 1024
    for key in (fake_key(), fake_key()):
        for _ in range(2):  # the second time from the gateway's memory of the refusal
            status, body = head_then_stall(gw.gateway_url, key, declared, start)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", body  # type: ignore[index]


def test_messages_and_parts_are_bounded_with_a_400_naming_the_limit(gw: Stack) -> None:
    url = gw.gateway_url + "/v1/chat/completions"
    many = [{"role": "user", "content": "x"}] * 2049
    resp = httpx.post(url, headers=ADMIN, json={"model": MODEL, "messages": many})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == "too_many_messages" and err["param"] == "messages", err
    assert "2048" in err["message"] and "EXAMLOPS_MAX_MESSAGES" in err["message"]

    parts = [{"type": "text", "text": "x"}] * 257
    resp = httpx.post(url, headers=ADMIN, json={"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == "too_many_parts", err
    assert err["param"] == "messages[0].content" and "EXAMLOPS_MAX_PARTS_PER_MESSAGE" in err["message"]

    at_limit = [{"role": "user", "content": "x"}] * 2048
    resp = httpx.post(url, headers=ADMIN, json={"model": MODEL, "messages": at_limit}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_a_large_body_is_parsed_and_served(gw: Stack) -> None:
    text = "word " * 100_000  # 500 KB: parsed in a worker thread
    resp = httpx.post(gw.gateway_url + "/v1/chat/completions", headers=ADMIN, timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"].startswith("echo: word")
