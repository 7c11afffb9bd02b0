"""The prefix-cache hit rate and speculative-decoding acceptance read from vLLM's /metrics counters."""

from __future__ import annotations

import pytest

from examlops_launcher._probe import parse_vllm_metrics, pool_metrics


def _page(hits: float, queries: float, accepted: float | None = None, drafted: float | None = None) -> str:
    """A /metrics page as vLLM 0.32 writes these counters (with their _created samples)."""
    lines = [
        "# TYPE vllm:prefix_cache_queries counter",
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="smol"}} {queries}',
        'vllm:prefix_cache_queries_created{engine="0",model_name="smol"} 1.7e9',
        "# TYPE vllm:prefix_cache_hits counter",
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="smol"}} {hits}',
        'vllm:prefix_cache_hits_created{engine="0",model_name="smol"} 1.7e9',
    ]
    if accepted is not None and drafted is not None:
        lines += [
            "# TYPE vllm:spec_decode_num_draft_tokens counter",
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="smol"}} {drafted}',
            "# TYPE vllm:spec_decode_num_accepted_tokens counter",
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="smol"}} {accepted}',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="smol",position="0"}} {accepted}',
        ]
    return "\n".join(lines) + "\n"


def test_ratios_of_the_server_life_counters() -> None:
    m = parse_vllm_metrics(_page(hits=30, queries=120, accepted=45, drafted=90))
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert m["spec_decode_acceptance_rate"] == pytest.approx(0.5)  # the per-position counter is not summed in
    assert m["prefix_cache_queries_total"] == 120 and m["spec_decode_draft_tokens_total"] == 90


def test_no_ratio_without_a_denominator() -> None:
    m = parse_vllm_metrics(_page(hits=0, queries=0))
    assert "prefix_cache_hit_rate" not in m and "spec_decode_acceptance_rate" not in m


def test_a_pool_ratio_is_recomputed_from_summed_counters() -> None:
    busy = parse_vllm_metrics(_page(hits=90, queries=100, accepted=10, drafted=100))
    idle = parse_vllm_metrics(_page(hits=0, queries=10))
    pool = pool_metrics([busy, idle])
    assert pool["prefix_cache_hit_rate"] == pytest.approx(90 / 110)  # not the mean of 0.9 and 0.0
    assert pool["spec_decode_acceptance_rate"] == pytest.approx(0.1)
