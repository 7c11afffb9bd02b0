"""The challenger judge's prompt/answer contract, its item sets, and the judge endpoint's fingerprint.

The judge route gets one OpenAI chat request through the gateway per item:

    {"model": <route>, "temperature": 0, "max_tokens": 48, "stream": false,
     "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                  {"role": "user", "content": "Question: ...\\nReference answer: ...\\nAnswer to grade: ..."}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA}}}

The gateway holds the answer to that schema (guided decoding in vLLM/SGLang, then its own validation
and one retry), so a 200 carries `{"verdict": "pass"|"fail", "score": 0..1}`. A 502
`structured_output_invalid` means the judge answered something else: no verdict. Any other failure
(gateway unreachable, route down, key refused) is a GatewayError: the judge was not heard at all.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from examlops.registry.v1 import registry_pb2 as reg

SYSTEM_PROMPT = (
    "You are a strict grader. Decide whether the answer to grade correctly and acceptably answers the "
    "question. When a reference answer is given, the answer passes only if it agrees with the reference "
    "in substance (wording may differ). Reply with JSON only: {\"verdict\": \"pass\" or \"fail\", "
    "\"score\": your confidence from 0 to 1 that the answer is acceptable}."
)
VERDICT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"verdict": {"type": "string", "enum": ["pass", "fail"]},
                   "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}
MAX_TOKENS = 48
LABELS = ("pass", "fail")
ITEM_FIELDS = {"id", "question", "answer", "reference", "label"}


class SetError(ValueError):
    """A set file that cannot be used; the message names the line."""


class GatewayError(RuntimeError):
    """The gateway could not get an answer from the judge route (nothing about the judge's opinion)."""


@dataclass(frozen=True)
class Item:
    line: int
    question: str
    answer: str
    reference: str = ""
    label: str = ""


@dataclass(frozen=True)
class Verdict:
    verdict: str | None  # "pass", "fail", or None: the judge answered no verdict
    score: float | None
    reason: str = ""     # why there is no verdict


def load_set(data: bytes, source: str, labelled: bool) -> list[Item]:
    """Items of a JSONL set (blank lines skipped); SetError names the first bad line."""
    items: list[Item] = []
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{source} line {number}"
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SetError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise SetError(f"{where}: expected a JSON object with question, answer"
                           f"{', label' if labelled else ''}")
        unknown = sorted(set(obj) - ITEM_FIELDS)
        if unknown:
            raise SetError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                           f"accepted: {', '.join(sorted(ITEM_FIELDS))}")
        for name in ("question", "answer"):
            if not isinstance(obj.get(name), str) or not obj[name].strip():
                raise SetError(f"{where}: {name!r} must be a non-empty string")
        reference = obj.get("reference", "")
        if not isinstance(reference, str):
            raise SetError(f"{where}: 'reference' must be a string")
        label = obj.get("label", "")
        if labelled and label not in LABELS:
            raise SetError(f"{where}: 'label' must be \"pass\" or \"fail\", got {label!r}")
        items.append(Item(number, obj["question"], obj["answer"], reference, label if labelled else ""))
    return items


def judge_request(route: str, item: Item) -> dict[str, Any]:
    """The chat request body the judge route receives for `item`."""
    parts = [f"Question: {item.question}"]
    if item.reference:
        parts.append(f"Reference answer: {item.reference}")
    parts.append(f"Answer to grade: {item.answer}")
    return {
        "model": route, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": False,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(parts)}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA}},
    }


def read_verdict(content: object) -> Verdict:
    """The judge's answer text → Verdict; anything but the schema's JSON is no verdict."""
    if not isinstance(content, str):
        return Verdict(None, None, "the answer has no text")
    try:
        obj = orjson.loads(content)
    except orjson.JSONDecodeError:
        return Verdict(None, None, "the answer is not JSON")
    verdict = obj.get("verdict") if isinstance(obj, dict) else None
    score = obj.get("score") if isinstance(obj, dict) else None
    if verdict not in LABELS:
        return Verdict(None, None, "the answer names no pass/fail verdict")
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score) \
            or not 0 <= score <= 1:
        return Verdict(None, None, "the answer's score is not a number from 0 to 1")
    return Verdict(str(verdict), float(score))


def _error_line(resp: httpx.Response) -> tuple[str, str]:
    """(code, one line) of a gateway error answer."""
    try:
        err = resp.json()["error"]
        return str(err.get("code") or ""), f"{resp.status_code} {err.get('type')}: {err.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", f"{resp.status_code}: {resp.text[:300]}"


class JudgeClient:
    """Asks the judge route through the gateway's OpenAI-compatible API with one HTTP client."""

    def __init__(self, gateway_url: str, key: str, route: str, actor: str, timeout_s: float = 300) -> None:
        self.gateway_url, self.route = gateway_url.rstrip("/"), route
        self._http = httpx.Client(timeout=timeout_s, headers={
            "Authorization": f"Bearer {key}", "X-Examlops-Actor": actor})

    def close(self) -> None:
        self._http.close()

    def ask(self, item: Item) -> Verdict:
        try:
            resp = self._http.post(self.gateway_url + "/v1/chat/completions", json=judge_request(self.route, item))
        except httpx.HTTPError as exc:
            raise GatewayError(f"cannot reach the gateway at {self.gateway_url} ({type(exc).__name__}); "
                               "is the stack up? `make up`, or set EXAMLOPS_GATEWAY_URL") from None
        if resp.status_code != 200:
            code, line = _error_line(resp)
            if code == "structured_output_invalid":
                return Verdict(None, None, "the judge's answer did not match the verdict schema")
            raise GatewayError(f"the gateway at {self.gateway_url} could not ask {self.route!r}: {line}")
        try:
            content = resp.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return Verdict(None, None, "the answer is not a chat completion")
        return read_verdict(content)


def endpoint_fingerprint(ep: reg.Endpoint) -> str:
    """What answers as the judge: its served model, engine block and creation time (a model put in its
    place under the same name has another fingerprint, so its calibration no longer holds)."""
    material = orjson.dumps([ep.served_model_name, ep.engine_block_json, ep.created_at_ms])
    return hashlib.sha256(material).hexdigest()
