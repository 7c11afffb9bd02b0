"""Speculative decoding measured per call, from the answering server's own counters.

vLLM counts, per server, `vllm:spec_decode_num_drafts_total` (engine steps that proposed draft
tokens), `vllm:spec_decode_num_draft_tokens_total` (tokens proposed) and
`vllm:spec_decode_num_accepted_tokens_total` (proposed tokens the target model accepted). A call's
figures are the deltas of those counters between the last scrape of its replica before the call
started (the background scrape, or a fresher one taken at the end of another call) and a scrape
taken right after its last byte arrived, before its final message is sent (services/engine-proxy/
README.md, "Speculative decoding per call"):

    acceptance_rate = accepted tokens / draft tokens          (0..1; 0 when nothing was proposed)
    speedup         = 1 + accepted tokens / drafts            (tokens per engine step, vLLM's mean
                                                               acceptance length; 1 without drafts)

The counters are per server, so calls running at the same time on one server share one window.
"""

from __future__ import annotations

from dataclasses import dataclass

from examlops.engine_proxy.v1 import engine_proxy_pb2 as pb

#: The bound of the scrape that opens (first call on a pool) or closes a call's window: the final
#: message waits for it, so it is short; a scrape that does not answer in time leaves SpecDecode out.
SPEC_SCRAPE_TIMEOUT_S = 1.0

#: the counters' names on a vLLM /metrics page, in SpecCounters' field order
SPEC_COUNTERS = (b"vllm:spec_decode_num_drafts_total", b"vllm:spec_decode_num_draft_tokens_total",
                 b"vllm:spec_decode_num_accepted_tokens_total")


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """One scrape of a server's speculative-decoding counters (summed over their label sets)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float


def spec_decode_between(before: SpecCounters | None, after: SpecCounters | None) -> pb.SpecDecode | None:
    """The call's SpecDecode from two scrapes; None when one is missing or a counter went back
    (the server restarted in between: the window is not one server's life)."""
    if before is None or after is None:
        return None
    drafts = after.drafts - before.drafts
    draft_tokens = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    if drafts < 0 or draft_tokens < 0 or accepted < 0:
        return None
    return pb.SpecDecode(acceptance_rate=min(1.0, accepted / draft_tokens) if draft_tokens else 0.0,
                         speedup=1.0 + accepted / drafts if drafts else 1.0,
                         draft_tokens=int(draft_tokens), accepted_tokens=int(accepted), drafts=int(drafts))
