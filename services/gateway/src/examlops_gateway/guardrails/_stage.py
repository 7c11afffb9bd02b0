"""The guardrail stage of the request path: the input scan before the engine call, the output scan
of a whole answer, and what fired (the response header, the counters, the cost record's `guarded`).

`GuardStage.check_input` costs one dict lookup when no policy applies to the key and the model.
Otherwise the prompt's texts are scanned by every input rule: a `block` finding settles the call
at zero cost and raises GuardrailBlocked (HTTP 400 `guardrail_blocked`, naming the message, never
the matched text); `redact` findings are replaced in the body the engine receives; `log` findings
are only reported. The streamed output's hold-back lives in _stream.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Tally
from collections.abc import Callable
from typing import Any

import orjson
from prometheus_client import Counter

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

from ..governance import Ticket
from ._detectors import Finding, redact
from ._judge import JudgeError
from ._store import Applied, GuardrailBook, Rule

ACTIONS = Counter("examlops_gateway_guardrail_actions_total", "Guardrail findings acted on (or judge errors).",
                  ["policy", "detector", "action", "direction"])
HEADER = "x-examlops-guardrails"
OFFLOAD_CHARS = 4_096    # texts longer than this in all are scanned in a worker thread (pii: ~3.6 ms at 4 KB)
JUDGE_DOWN = "JUDGE_UNAVAILABLE"


class GuardrailBlocked(Exception):
    """A block: what fired and where, never the matched text. `produced`: the engine's last chunk
    when an answer was blocked (what to charge)."""

    def __init__(self, policy: str, detector: str, entity: str, direction: str, param: str | None,
                 why: str = "", produced: pb.GenerateChunk | None = None) -> None:
        where = param or ("the prompt" if direction == "input" else "the answer")
        why = why or f"the {detector} detector found {entity}"
        super().__init__(f"guardrail policy '{policy}' blocked {where}: {why}")
        self.policy, self.detector, self.entity, self.direction, self.param = policy, detector, entity, direction, param
        self.produced = produced


#: Told of every block (policy, detector, entity, direction) for the audit trail; must not block.
OnBlock = Callable[[Ticket, str, str, str, str], None]


class Guard:
    """The guardrails of one call: its rules, and the report of what fired."""

    def __init__(self, applied: Applied, ticket: Ticket, on_block: OnBlock | None = None) -> None:
        self.applied, self.ticket, self.on_block = applied, ticket, on_block
        self.fired: Tally[tuple[str, str, str, str, str]] = Tally()

    def report(self, rule: Rule, finding: Finding, direction: str, action: str | None = None) -> None:
        action = action or rule.entry.action
        self.fired[(rule.policy, rule.entry.detector, finding.entity, action, direction)] += 1
        ACTIONS.labels(rule.policy, rule.entry.detector, action, direction).inc()
        self.ticket.guarded = self.header()
        if action == "block" and self.on_block is not None:
            self.on_block(self.ticket, rule.policy, rule.entry.detector, finding.entity, direction)

    def header(self) -> str:
        """`policy/detector/entity/action=count, …` (no matched text)."""
        return ", ".join(f"{p}/{d}/{e}/{a}={n}" for (p, d, e, a, _), n in sorted(self.fired.items()))

    def headers(self) -> dict[str, str]:
        return {HEADER: self.header()} if self.fired else {}

    async def scan(self, rules: tuple[Rule, ...], texts: list[str], direction: str,
                   params: list[str]) -> dict[int, list[Finding]]:
        """Every rule on every text; raises GuardrailBlocked on a block (or a judge down, failing
        closed); returns the redactions to make, by text index."""
        cpu = [r for r in rules if r.detector is not None]

        def run() -> list[tuple[Rule, int, Finding]]:
            return [(r, i, f) for r in cpu for i, t in enumerate(texts) for f in r.detector.scan(t)]  # type: ignore[union-attr]

        hits = await asyncio.to_thread(run) if sum(map(len, texts)) > OFFLOAD_CHARS else run()
        for rule in rules:
            if rule.judge is not None:
                hits += await self.judge(rule, texts, direction)
        for rule, i, f in hits:
            if rule.entry.action == "block":
                self.report(rule, f, direction)
                raise GuardrailBlocked(rule.policy, rule.entry.detector, f.entity, direction,
                                       params[i] if i >= 0 else None)
        redactions: dict[int, list[Finding]] = {}
        for rule, i, f in hits:
            self.report(rule, f, direction)
            if rule.entry.action == "redact" and i >= 0:
                redactions.setdefault(i, []).append(f)
        return redactions

    async def judge(self, rule: Rule, texts: list[str], direction: str) -> list[tuple[Rule, int, Finding]]:
        """One judge call on all the texts (a verdict, not spans); a judge that fails blocks unless
        the entry says on_error: allow."""
        try:
            assert rule.judge is not None
            return [(rule, -1, f) for f in await rule.judge.scan("\n\n".join(texts))]
        except JudgeError as exc:
            down = Finding("model", JUDGE_DOWN, 0, 0)
            if rule.entry.on_error == "allow":
                self.report(rule, down, direction, "allow")
                return []
            self.report(rule, down, direction, "block")
            raise GuardrailBlocked(rule.policy, "model", JUDGE_DOWN, direction, None,
                                   why=f"the judge route '{rule.entry.route}' did not answer "
                                       f"({type(exc).__name__}; failing closed)") from None

    async def check_answer(self, chunk: pb.GenerateChunk) -> pb.GenerateChunk:
        """A whole (non-streamed) answer: scanned before it is returned; redacted or blocked."""
        if not self.applied.output or not chunk.data:
            return chunk
        obj = orjson.loads(chunk.data)
        spots = [(c, "message" in c) for c in obj.get("choices") or [] if isinstance(c, dict)]
        holders = [(c["message"], "content") if chat else (c, "text") for c, chat in spots]
        found = [(h, k) for h, k in holders if isinstance(h, dict) and isinstance(h.get(k), str)]
        params = [f"choices[{i}]" for i in range(len(found))]
        try:
            redactions = await self.scan(self.applied.output, [h[k] for h, k in found], "output", params)
        except GuardrailBlocked as exc:
            exc.produced = chunk
            raise
        if not redactions:
            return chunk
        for i, fs in redactions.items():
            holder, key = found[i]
            holder[key] = redact(holder[key], fs)
        out = pb.GenerateChunk()
        out.CopyFrom(chunk)
        out.data = orjson.dumps(obj)
        return out


def _prompt_texts(body: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(param, container, key) of every text in a request: message contents and their text parts,
    or a completion's prompt(s); token-id prompts carry no text."""
    spots: list[tuple[str, Any, Any]] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                spots.append((f"messages[{i}]", m, "content"))
            elif isinstance(content, list):
                spots += [(f"messages[{i}].content[{j}]", p, "text") for j, p in enumerate(content)
                          if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return spots
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [("prompt", body, "prompt")]
    if isinstance(prompt, list):
        spots = [(f"prompt[{j}]", prompt, j) for j, p in enumerate(prompt) if isinstance(p, str)]
    return spots


class GuardStage:
    """The stage object of the request path (see the module docstring)."""

    def __init__(self, book: GuardrailBook, on_block: OnBlock | None = None) -> None:
        self.book, self.on_block = book, on_block

    async def check_input(self, ticket: Ticket) -> Guard | None:
        """None when no policy applies; else the call's Guard, its body redacted where asked.
        Raises GuardrailBlocked once the call is settled (a block costs nothing)."""
        applied = self.book.applied(ticket.guardrails, ticket.model)
        if applied is None:
            return None
        guard = Guard(applied, ticket, self.on_block)
        if not applied.input:
            return guard
        body = orjson.loads(ticket.body)
        spots = _prompt_texts(body)
        texts = [c[k] for _, c, k in spots]
        try:
            redactions = await guard.scan(applied.input, texts, "input", [p for p, _, _ in spots])
        except GuardrailBlocked:
            await ticket.settle("400")
            raise
        if redactions:
            for i, fs in redactions.items():
                _, container, key = spots[i]
                container[key] = redact(texts[i], fs)
            ticket.body = orjson.dumps(body)
        return guard
