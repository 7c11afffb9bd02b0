"""The engine block's `task`: generate (chat, completions) or embed (/v1/embeddings, pooling runner)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from examlops.engine import (
    TASKS,
    EngineBlockError,
    find_model,
    parse_engine_block,
    render_sglang_command,
    render_vllm_command,
    task_of,
)

SAMPLE_PACK = Path(__file__).resolve().parents[3] / "usecases" / "sample"
BASE: dict[str, Any] = {"engine": "vllm", "hf_model_id": "org/model"}
EMBED: dict[str, Any] = {**BASE, "task": "embed"}


def issues(data: dict[str, Any]) -> dict[str, tuple[Any, str, tuple[str, ...]]]:
    with pytest.raises(EngineBlockError) as caught:
        parse_engine_block(data)
    return {i.field: (i.value, i.message, i.accepted) for i in caught.value.issues}


def test_task_defaults_to_generate_and_takes_embed() -> None:
    assert TASKS == ("generate", "embed")
    assert parse_engine_block(BASE).task == "generate"
    block = parse_engine_block(EMBED)
    assert block.task == "embed"
    assert parse_engine_block(block.model_dump(mode="json")) == block  # the registry's round trip


def test_an_unknown_task_names_the_accepted_ones() -> None:
    value, message, accepted = issues({**BASE, "task": "chat"})["engine.task"]
    assert value == "chat" and "not accepted" in message and accepted == TASKS


@pytest.mark.parametrize("engine", ["sglang", "vllm-inproc"])
def test_only_engines_that_serve_embeddings_take_task_embed(engine: str) -> None:
    value, message, accepted = issues({**EMBED, "engine": engine})["engine.task"]
    assert value == "embed" and engine in message and "embeddings" in message
    assert "generate" in accepted and any("vllm-server" in a and "echo" in a for a in accepted)
    assert parse_engine_block({"engine": "echo", "task": "embed"}).task == "embed"


def test_an_embedding_model_has_nothing_to_draft() -> None:
    spec = {"enabled": True, "method": "ngram"}
    value, message, _ = issues({**EMBED, "speculative_decoding": spec})[
        "engine.speculative_decoding.enabled"]
    assert value is True and "task: embed" in message
    # A disabled block is harmless (a copied template), and generate keeps its spec decode.
    parse_engine_block({**EMBED, "speculative_decoding": {**spec, "enabled": False}})
    parse_engine_block({**BASE, "speculative_decoding": spec})


def test_an_embedding_endpoint_is_text_only() -> None:
    vision = {"modality": "vision", "limit_mm_per_prompt": {"image": 1}}
    value, message, accepted = issues({**EMBED, "multimodal": vision})["engine.multimodal.modality"]
    assert value == "vision" and "text" in message and accepted == ("text",)


def test_every_embed_issue_is_reported_at_once() -> None:
    found = issues({**EMBED, "engine": "sglang", "speculative_decoding": {"enabled": True, "method": "ngram"}})
    assert {"engine.task", "engine.speculative_decoding.enabled"} <= set(found)


def test_embed_renders_the_pooling_runner_and_generate_renders_nothing() -> None:
    embed = render_vllm_command(parse_engine_block(EMBED)).argv
    assert embed[embed.index("--runner") + 1] == "pooling" and embed.count("--runner") == 1
    assert "--convert" not in embed  # auto: a native embedding model stays as it is
    plain = render_vllm_command(parse_engine_block(BASE)).argv
    assert "--runner" not in plain and "--convert" not in plain


@pytest.mark.parametrize(("args", "where"), [
    (["--runner", "pooling"], "engine.extra_args.0"),
    (["--convert=embed"], "engine.extra_args.0"),
    (["--enforce-eager", "--runn", "generate"], "engine.extra_args.1"),
])
def test_the_runner_is_the_task_fields_not_extra_args(args: list[str], where: str) -> None:
    _, message, _ = issues({**EMBED, "extra_args": args})[where]
    assert "set by task" in message


def test_sglang_owns_its_embedding_switch() -> None:
    found = issues({"engine": "sglang", "hf_model_id": "m", "extra_args": ["--is-embedding"]})
    assert "set by task" in found["engine.extra_args.0"][1]
    assert "--is-embedding" not in render_sglang_command(
        parse_engine_block({"engine": "sglang", "hf_model_id": "m"})).argv


def test_the_sample_minilm_is_an_embedding_endpoint() -> None:
    spec = find_model("minilm", SAMPLE_PACK)
    assert (spec.engine.task, spec.engine.served_model_name, spec.engine.dtype) == ("embed", "minilm", "float32")
    assert spec.engine.max_model_len == 256 and spec.engine.speculative_decoding is None


@pytest.mark.parametrize(("stored", "task"), [
    (json.dumps({"engine": "vllm-server", "task": "embed", "hf_model_id": "m"}), "embed"),
    (json.dumps({"engine": "echo", "task": "generate"}), "generate"),
    (json.dumps({"engine": "echo"}), "generate"),
    ("", "generate"), ("not json", "generate"), ("[1, 2]", "generate"), ('{"task": 3}', "generate"),
    ('{"task": "EMBED"}', "generate"),
])
def test_task_of_reads_a_stored_block_and_never_raises(stored: str, task: str) -> None:
    assert task_of(stored) == task
