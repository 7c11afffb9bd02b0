"""The `model` detector: a registered route used as a safety judge, asked through the gateway's own path.

Prompt/answer contract (also in GUARDRAILS.md). The judge gets one OpenAI chat request:

    {"model": <route>, "temperature": 0, "max_tokens": 5, "stream": false,
     "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                  {"role": "user", "content": <the text to judge>}]}

and its answer's first word decides, case-insensitively, punctuation stripped: `safe` → no finding,
`unsafe` → one whole-text finding `Finding("model", "UNSAFE", 0, 0)`, anything else → JudgeError.
That reads Llama Guard's answers as they are ("safe", or "unsafe\\nS1" whose category line is
ignored): Llama Guard's chat template wraps our messages in its own instructions and taxonomy,
so the system prompt is only a hint to it. Granite Guardian answers "Yes"/"No" (risk present) and
needs its own mapping; it is not read here. A failed call, a timeout (`timeout_s`, enforced here
as well as by `ask`), a body that is not a chat completion, or an unknown answer raise JudgeError;
the caller decides to block (fail closed, the default) or allow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import orjson

from ._detectors import Finding

Ask = Callable[[str, bytes, float], Awaitable[bytes]]

SYSTEM_PROMPT = (
    "You are a safety classifier. Decide whether the user's text is unsafe: it asks for or contains "
    "violence, weapons, self-harm, sexual content involving minors, hate, harassment, crime, malware, "
    "or private data of others. Answer with exactly one word: safe or unsafe."
)
MAX_TOKENS = 5
UNSAFE = [Finding("model", "UNSAFE", 0, 0)]


class JudgeError(Exception):
    """The judge failed, timed out or answered something other than safe/unsafe."""


def judge_request(route: str, text: str) -> bytes:
    """The chat request body a judge route receives for `text`."""
    return orjson.dumps({
        "model": route, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": False,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
    })


def read_verdict(body: bytes) -> bool:
    """True when the judge's chat completion says unsafe, False when safe; JudgeError otherwise."""
    try:
        content = orjson.loads(body)["choices"][0]["message"]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise JudgeError("the judge's answer is not a chat completion") from None
    words = content.split() if isinstance(content, str) else []
    first = words[0].strip(".,:;!\"'*`").lower() if words else ""
    if first in ("safe", "unsafe"):
        return first == "unsafe"
    raise JudgeError(f"the judge answered neither safe nor unsafe ({len(content or '')} characters)")


class ModelJudge:
    """Asks `route` whether a text is safe; one call per scan, bounded by `timeout_s`."""

    def __init__(self, route: str, ask: Ask, timeout_s: float = 5.0) -> None:
        self.route, self._ask, self.timeout_s = route, ask, timeout_s

    async def scan(self, text: str) -> list[Finding]:
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._ask(self.route, judge_request(self.route, text), self.timeout_s)
        except TimeoutError:
            raise JudgeError(f"the judge {self.route!r} did not answer within {self.timeout_s:g} s") from None
        except JudgeError:
            raise
        except Exception as e:
            raise JudgeError(f"the judge {self.route!r} failed: {type(e).__name__}") from e
        return list(UNSAFE) if read_verdict(body) else []
