"""Through the gateway: an allowed media host that resolves to a private address is a 400 naming the part."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from examlops.svc import DEFAULT_ADMIN_KEY
from examlops_testsupport.dns import private_host_name
from examlops_testsupport.fixtures import Stack, wait_until
from examlops_testsupport.media_corpus import PART_PARAM, image, request

HOST, _ = private_host_name()


def _policy(**extra: object) -> dict[str, object]:
    return {"modality": "vision", "limit_mm_per_prompt": {"image": 1}, "allowed_media_domains": [HOST], **extra}


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    stack.register("vision-closed", engine="echo", engine_block_json=json.dumps({"engine": "echo",
                                                                                 "multimodal": _policy()}))
    stack.register("vision-internal", engine="echo", engine_block_json=json.dumps(
        {"engine": "echo", "multimodal": _policy(allow_private_addresses=True)}))
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=DEFAULT_ADMIN_KEY, max_retries=0) as c:
        wait_until(lambda: {"vision-closed", "vision-internal"} <= {m.id for m in c.models.list()})
        yield c


def test_a_private_address_behind_an_allowed_domain_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="vision-closed", messages=request(image(f"http://{HOST}/cat.png")))
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "media_private_address" and body["param"] == PART_PARAM, body
    assert HOST in body["message"]


def test_an_endpoint_whose_policy_allows_private_addresses_takes_it(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="vision-internal", messages=request(image(f"http://{HOST}/cat.png")))
    assert reply.choices[0].message.content
