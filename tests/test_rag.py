"""`exa rag index` and `exa rag query` against the real services, with echo routes (no vLLM).

Echo embeds each input to its own deterministic unit vector, so a question that is exactly a chunk's
embedding input finds that chunk with cosine 1; echo's chat answer is the prompt it was given, so the
test reads the prompt `query` built.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from examlops_cli._rag_chunk import chunk_text
from examlops_testsupport.fixtures import Stack, free_port, wait_until

GUIDE = """# Operating guide

The gateway routes every call to a registered endpoint.

## Budgets

Budgets are reserve-then-settle. Each call reserves its upper bound before dispatch.

""" + "\n\n".join(f"Paragraph {i} says something about quotas and spend, in many words." for i in range(12))

NOTES = "Plain notes: the launcher renders one vllm serve argv for every substrate."


@pytest.fixture(scope="module")
def routes(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`rag-embed`: echo embeddings; `default`: echo chat (what `exa rag query` generates through)."""
    stack.register("rag-embed", engine="echo", engine_block_json=json.dumps({"engine": "echo", "task": "embed"}))
    stack.register("default", engine="echo")
    probe = tmp_path_factory.mktemp("rag-probe")
    (probe / "a.txt").write_text("probe")
    wait_until(lambda: cli(stack, probe / "rag", "index", str(probe), "--collection", "probe",
                           "--model", "rag-embed").returncode == 0, timeout_s=10, what="rag-embed routable")
    wait_until(lambda: stack.cli("gateway", "chat", "default", "-m", "ping").returncode == 0, timeout_s=10,
               what="default routable")


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    (folder / "guide.md").write_text(GUIDE)
    (folder / "notes.txt").write_text(NOTES)
    (folder / "sub" / "deep.markdown").write_text("# Deep\n\nA nested file is read too.")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (folder / "blob.txt").write_bytes(b"text then \0 binary")
    (folder / ".hidden" / "secret.md").write_text("never indexed")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "cached.txt").write_text("never indexed")
    for name in ("a.py", "b.py"):
        (folder / "sub" / name).write_text("print()")
    return folder


def cli(stack: Stack, rag_dir: Path, *args: str, gateway: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"EXAMLOPS_RAG_DIR": str(rag_dir), **({"EXAMLOPS_GATEWAY_URL": gateway} if gateway else {})}
    return stack.cli("rag", *args, env=env)


def test_index_stores_the_collection_and_reindex_replaces_it(stack: Stack, routes: None, docs: Path,
                                                             tmp_path: Path) -> None:
    rag = tmp_path / "rag"
    out = cli(stack, rag, "index", str(docs), "--collection", "team-docs", "--model", "rag-embed",
              "--chunk-chars", "300", "--overlap", "40")
    assert out.returncode == 0, out.stderr
    assert "skipped logo.png: not a text or markdown file (.png)" in out.stderr
    assert "skipped blob.txt: binary content" in out.stderr
    assert "skipped 2 files, not a text or markdown file (.py): sub/a.py, sub/b.py" in out.stderr
    assert "secret" not in out.stderr + out.stdout and "cached" not in out.stderr + out.stdout

    link = rag / "team-docs"
    assert link.is_symlink()
    meta = json.loads((link / "meta.json").read_text())
    assert meta["embedding_model"] == "rag-embed" and meta["dimension"] == 384
    assert {s["path"]: s["sha256"] for s in meta["sources"]} == {
        p: hashlib.sha256((docs / p).read_bytes()).hexdigest() for p in ("guide.md", "notes.txt", "sub/deep.markdown")}
    chunks = [json.loads(line) for line in (link / "chunks.jsonl").read_text().splitlines()]
    vectors = np.load(link / "vectors.npy")
    assert vectors.dtype == np.float32 and vectors.shape == (len(chunks), 384) == (meta["chunks"], 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert all(len(c["text"]) <= 300 for c in chunks)
    guide = [c for c in chunks if c["source"] == "guide.md"]
    assert len(guide) > 3 and [c["chunk"] for c in guide] == list(range(1, len(guide) + 1))
    assert any(c["section"] == "Budgets" and c["text"].startswith("## Budgets") for c in guide)

    (docs / "notes.txt").unlink()
    again = cli(stack, rag, "--json", "index", str(docs), "--collection", "team-docs", "--model", "rag-embed")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["chunks"] < meta["chunks"]
    replaced = json.loads((link / "meta.json").read_text())
    assert [s["path"] for s in replaced["sources"]] == ["guide.md", "sub/deep.markdown"]
    assert len([p for p in os.listdir(rag) if p.startswith(".build~team-docs~")]) == 1  # the old build is gone

    listed = json.loads(cli(stack, rag, "--json", "list").stdout)
    assert [(r["collection"], r["chunks"], r["embedding_model"]) for r in listed] == [
        ("team-docs", replaced["chunks"], "rag-embed")]
    assert "team-docs" in cli(stack, rag, "list").stdout


def test_query_answers_through_the_default_route_with_sources(stack: Stack, routes: None, docs: Path,
                                                              tmp_path: Path) -> None:
    rag = tmp_path / "rag"
    assert cli(stack, rag, "index", str(docs), "--collection", "c1", "--model", "rag-embed").returncode == 0
    question = f"notes.txt\n{NOTES}"  # exactly what was embedded for notes.txt's only chunk
    out = cli(stack, rag, "query", question, "--collection", "c1", "-k", "2", "--max-tokens", "2000")
    assert out.returncode == 0, out.stderr
    answer, sources = out.stdout.split("\nSources:\n")
    assert answer.startswith("echo: Context:")  # echo repeats the prompt: the context, then the question
    assert "[1] notes.txt (chunk 1 of 1, line 1)" in answer and answer.rstrip().endswith(NOTES)
    lines = sources.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1] notes.txt (chunk 1 of 1") and lines[0].endswith("score 1.000")

    as_json = json.loads(cli(stack, rag, "--json", "query", question, "--collection", "c1").stdout)
    assert as_json["model"] == "default" and as_json["answer"].startswith("echo:")
    assert as_json["sources"][0]["source"] == "notes.txt" and as_json["sources"][0]["score"] == pytest.approx(1)
    assert len(as_json["sources"]) == 4 and as_json["usage"]["prompt_tokens"] > 0


def test_failed_gateway_calls_give_no_answer(stack: Stack, routes: None, docs: Path, tmp_path: Path) -> None:
    rag = tmp_path / "rag"
    assert cli(stack, rag, "index", str(docs), "--collection", "c2", "--model", "rag-embed").returncode == 0
    built = (rag / "c2" / "meta.json").read_text()

    missing = cli(stack, rag, "query", "what?", "--collection", "c2", "--model", "no-such-route")
    assert (missing.returncode, missing.stdout.strip()) == (1, "(no answer)")
    assert "model_not_found" in missing.stderr

    dead = f"http://127.0.0.1:{free_port()}"
    down = cli(stack, rag, "query", "what?", "--collection", "c2", gateway=dead)
    assert (down.returncode, down.stdout.strip()) == (1, "(no answer)")
    assert f"cannot reach the gateway at {dead}" in down.stderr
    down_json = cli(stack, rag, "--json", "query", "what?", "--collection", "c2", gateway=dead)
    assert down_json.returncode == 1 and json.loads(down_json.stdout)["answer"] is None

    # an index that cannot embed leaves the collection as it was
    failed = cli(stack, rag, "index", str(docs), "--collection", "c2", "--model", "rag-embed", gateway=dead)
    assert failed.returncode == 1 and "collection 'c2' unchanged" in failed.stderr
    wrong_task = cli(stack, rag, "index", str(docs), "--collection", "c2", "--model", "default")
    assert wrong_task.returncode == 1 and "model_task_mismatch" in wrong_task.stderr
    assert (rag / "c2" / "meta.json").read_text() == built


def test_collection_errors_name_the_fix(stack: Stack, tmp_path: Path, docs: Path) -> None:
    rag = tmp_path / "rag"
    unknown = cli(stack, rag, "query", "what?", "--collection", "nothing-here")
    assert unknown.returncode == 1 and "exa rag index PATH --collection nothing-here" in unknown.stderr
    bad = cli(stack, rag, "index", str(docs), "--collection", "../up")
    assert bad.returncode == 1 and "invalid collection name" in bad.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.bin").write_bytes(b"\0")
    none = cli(stack, rag, "index", str(empty), "--collection", "e")
    assert none.returncode == 1 and "no text or markdown files" in none.stderr
    assert "no collections" in cli(stack, rag, "list").stdout


def test_chunks_follow_headings_paragraphs_and_fences() -> None:
    code = "```\n# not a heading\n\nstill code\n```"
    text = f"# Title\n\nintro\n\n## Part\n\n{'word ' * 400}\n\n{code}\n\nafter"
    chunks = chunk_text(text, chunk_chars=200, overlap=30)
    assert all(len(c.text) <= 200 for c in chunks)
    assert chunks[0].section == "Title" and chunks[0].text == "# Title\n\nintro"
    assert chunks[1].section == "Part" and chunks[1].text.startswith("## Part") and chunks[1].line == 5
    assert any(code in c.text for c in chunks) and all(c.section == "Part" for c in chunks[1:])
    assert chunks[-1].text.endswith("after")


def test_a_write_that_dies_midway_leaves_the_previous_collection(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from examlops_cli import _rag_store
    from examlops_cli._output import Ctx

    monkeypatch.setenv("EXAMLOPS_RAG_DIR", str(tmp_path))
    monkeypatch.setattr(Ctx, "_settings", None)
    first = np.eye(2, dtype=np.float32)
    _rag_store.write_collection("c", {"embedding_model": "m"}, [{"text": "a"}, {"text": "b"}], first)

    def crash(*_: object, **__: object) -> None:  # the process dying while the new vectors are written
        raise KeyboardInterrupt

    monkeypatch.setattr(_rag_store.np, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        _rag_store.write_collection("c", {"embedding_model": "m"}, [{"text": "new"}], np.ones((1, 2), np.float32))
    kept = _rag_store.load_collection("c")
    assert [c["text"] for c in kept.chunks] == ["a", "b"] and np.array_equal(kept.vectors, first)
    assert len([p for p in os.listdir(tmp_path) if p.startswith(".build~")]) == 1
