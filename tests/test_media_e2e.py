"""Media safety end to end: the hostile and allowed corpora through the gateway and `exa serve llm chat`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.media_corpus import (
    ALLOWED,
    HOSTILE,
    HOSTILE_REQUESTS,
    PART_PARAM,
    PNG,
    POLICY_KWARGS,
    SVG,
    corpus,
    make_media_root,
    request,
)
from examlops_testsupport.recorder import RecordingServer

ENDPOINT = "vision-echo"  # the policy the corpus assumes (POLICY_KWARGS)
LOCAL = "vision-local"     # the same with a local media root (corpus(root).policy_kwargs)


@pytest.fixture(scope="module")
def media(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Any]]:
    root = make_media_root(tmp_path_factory.mktemp("media"))
    local = corpus(root)
    stack.register(ENDPOINT, engine="echo", engine_block_json=json.dumps(
        {"engine": "echo", "multimodal": POLICY_KWARGS}))
    stack.register(LOCAL, engine="echo", engine_block_json=json.dumps(
        {"engine": "echo", "multimodal": local.policy_kwargs}))
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0)
    ftp = request({"type": "image_url", "image_url": {"url": "ftp://x/"}})
    wait_until(lambda: _status_of(client, ENDPOINT, ftp) == 400)
    yield client, local
    client.close()


def _rejection(client: openai.OpenAI, messages: list[Any], model: str = ENDPOINT) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages)
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_every_hostile_part_is_rejected_with_its_code(media: tuple[openai.OpenAI, Any]) -> None:
    client, local = media
    wrong = []
    cases = [(ENDPOINT, c) for c in HOSTILE] + [(LOCAL, c) for c in local.hostile]
    for model, (cls, part, code) in cases:
        body = _rejection(client, request(part), model)
        if (body["code"], body["param"], body["type"]) != (code, PART_PARAM, "invalid_request_error"):
            wrong.append((cls, part if len(str(part)) < 200 else str(part)[:200], code, body))
    assert not wrong, wrong
    assert len(HOSTILE) + len(local.hostile) >= 60


def test_hostile_whole_requests(media: tuple[openai.OpenAI, Any]) -> None:
    client, _ = media
    for cls, messages, code, param in HOSTILE_REQUESTS:
        body = _rejection(client, messages)
        if cls == "message_shape":  # not a chat request at all: the gateway's schema refuses it first
            assert body["code"] == "invalid_value" and body["param"].startswith("messages.0")
        else:
            assert (body["code"], body["param"]) == (code, param)


def test_every_allowed_part_is_accepted(media: tuple[openai.OpenAI, Any]) -> None:
    client, local = media
    for model, (part, _url) in [(ENDPOINT, a) for a in ALLOWED] + [(LOCAL, a) for a in local.allowed]:
        resp = client.chat.completions.create(model=model, messages=request(part))
        assert (resp.choices[0].message.content or "").startswith("echo: what is this?")


def test_rejected_media_never_reaches_the_engine_and_the_checked_url_is_forwarded(
        stack: Stack, media: tuple[openai.OpenAI, Any]) -> None:
    server = RecordingServer()
    try:
        block = {"engine": "vllm", "hf_model_id": "org/vl", "multimodal": {
            "modality": "vision", "limit_mm_per_prompt": {"image": 2}, "allowed_media_domains": ["example.com"]}}
        stack.register("vision-rec", engine="vllm-server", base_url=server.url, engine_block_json=json.dumps(block))
        client, _ = media
        ok = request({"type": "image_url", "image_url": {"url": "HTTP://IMG.Example.COM:80/a.png"}})
        wait_until(lambda: _status_of(client, "vision-rec", ok) == 200)
        server.bodies.clear()
        for url in ("http://169.254.169.254/latest/meta-data", "http://example.com@evil.com/",
                    "http://2130706433/", "file:///etc/passwd"):
            assert _status_of(client, "vision-rec", request({"type": "image_url", "image_url": {"url": url}})) == 400
        assert server.bodies == []
        assert _status_of(client, "vision-rec", ok) == 200
        forwarded = server.bodies[0]["messages"][0]["content"][1]["image_url"]["url"]
        assert forwarded == "http://img.example.com/a.png"
    finally:
        server.close()


def _status_of(client: openai.OpenAI, model: str, messages: list[Any]) -> int:
    try:
        client.chat.completions.create(model=model, messages=messages)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_text_only_endpoint_drops_media_with_a_warning(stack: Stack, media: tuple[openai.OpenAI, Any]) -> None:
    stack.register("text-echo", engine="echo")
    body = {"model": "text-echo", "messages": request({"type": "image_url", "image_url": {"url": "http://x.org/a.png"}})}

    def answered() -> httpx.Response | None:
        r = httpx.post(stack.gateway_url + "/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {DEFAULT_ADMIN_KEY}"})
        return r if r.status_code == 200 else None
    wait_until(answered)
    resp = answered()
    assert resp is not None
    assert resp.json()["choices"][0]["message"]["content"] == "echo: what is this?"
    assert resp.headers["x-examlops-media-parts-dropped"] == "1"
    assert "dropped 1 media part" in resp.headers["x-examlops-warning"]
    cli = stack.cli("serve", "llm", "chat", "text-echo", "-m", "look", "--image", "http://x.org/a.png")
    assert cli.returncode == 0 and "dropped 1 media part" in cli.stderr


def _url_parts() -> list[tuple[str, str]]:
    """Corpus entries an operator can type as `--image URL`: (url, expected code or '')."""
    out = []
    for _cls, part, code in HOSTILE:
        plain = isinstance(part, dict) and set(part) == {"type", "image_url"} and part["type"] == "image_url"
        url = part["image_url"] if plain else None
        url = url.get("url") if isinstance(url, dict) and set(url) == {"url"} else url
        if isinstance(url, str) and "://" in url and url.isprintable() and len(url) < 4000:
            out.append((url, code))
    return out


def test_cli_image_flag_applies_the_same_guard(stack: Stack, media: tuple[openai.OpenAI, Any], tmp_path: Path) -> None:
    cases = _url_parts()
    assert len(cases) >= 60
    (tmp_path / "ok.png").write_bytes(PNG)
    (tmp_path / "evil.svg").write_bytes(SVG)
    cases += [(str(tmp_path / "ok.png"), ""), (str(tmp_path / "evil.svg"), "media_type_not_allowed"),
              ("https://img.example.com/cat.png", ""), ("HTTPS://EXAMPLE.COM/a.png", "")]

    def run(case: tuple[str, str]) -> tuple[str, str, int, str]:
        out = stack.cli("serve", "llm", "chat", ENDPOINT, "-m", "what is this?", "--image", case[0])
        return case[0], case[1], out.returncode, out.stdout + out.stderr

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, cases))
    wrong = [r for r in results if (r[2] == 0) != (r[1] == "") or (r[1] and r[1] not in r[3])]
    assert not wrong, wrong[:5]
