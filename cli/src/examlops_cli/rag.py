"""`exa rag …`: answer questions from your own documents through the gateway.

`index` cuts text and markdown files into chunks and embeds them through the gateway's
`/v1/embeddings` route (default `minilm`); `query` embeds a question with the same route, takes the
most similar chunks and has a chat route (default `default`) answer from them, citing its sources.
Both are ordinary gateway callers: the key, budget, rate limits and cost records apply as to any
client. A failed generation is never replaced by a stand-in: `(no answer)`, the reason, exit 1.
"""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import numpy as np
import orjson
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ._output import Ctx, console, emit_json, err_console, fail, table
from ._rag_chunk import TEXT_SUFFIXES, chunk_text, collect_files, embedding_input
from ._rag_store import (
    CollectionError,
    Vectors,
    check_name,
    list_collections,
    load_collection,
    normalized,
    rag_root,
    top_k,
    write_collection,
)
from .gateway import error_line, gateway_send, unreachable_line

app = typer.Typer(help="Retrieval-augmented answers from your documents, through the gateway.\n\n"
                       "Collections live in ${XDG_DATA_HOME:-~/.local/share}/examlops/rag "
                       "(EXAMLOPS_RAG_DIR overrides).", no_args_is_help=True)

SYSTEM_PROMPT = ("Answer the user's question using only the numbered context passages they give. "
                 "If the passages do not contain the answer, say that you do not know. Answer briefly.")
NOTE_EXAMPLES = 3


class GatewayCallError(RuntimeError):
    """A gateway call that gave no usable answer; the message is the reason."""


def _post(path: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    try:
        resp = gateway_send("POST", path, key, content=orjson.dumps(body))
    except httpx.HTTPError as exc:
        raise GatewayCallError(unreachable_line(exc)) from None
    if resp.status_code != 200:
        raise GatewayCallError(error_line(resp))
    try:
        out: dict[str, Any] = resp.json()
    except ValueError:
        raise GatewayCallError(f"the gateway answered {path} with something that is not JSON") from None
    return out


def embed(texts: list[str], model: str, key: str | None) -> Vectors:
    """Normalized float32 rows, one per text, from the gateway's embeddings route `model`.

    A text longer than the model's window is embedded from its first tokens (vLLM's
    `truncate_prompt_tokens: -1`): a chunk dense in symbols can pass MiniLM's 256 tokens in 600
    characters, and its beginning still places it; the prompt gets the whole chunk.
    """
    obj = _post("/v1/embeddings", {"model": model, "input": texts, "encoding_format": "float",
                                   "truncate_prompt_tokens": -1}, key)
    try:
        rows = sorted(obj["data"], key=lambda d: d["index"])
        vectors = np.asarray([row["embedding"] for row in rows], dtype=np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise GatewayCallError(f"route {model!r} returned no usable embeddings ({exc})") from None
    if vectors.ndim != 2 or vectors.shape[0] != len(texts):
        raise GatewayCallError(f"route {model!r} returned {len(obj.get('data') or [])} embeddings "
                               f"for {len(texts)} inputs")
    return normalized(vectors)


def _embed_all(texts: list[str], model: str, key: str | None, batch: int,
               advance: Callable[[int], None]) -> Vectors:
    parts: list[Vectors] = []
    for start in range(0, len(texts), batch):
        part = embed(texts[start:start + batch], model, key)
        if parts and part.shape[1] != parts[0].shape[1]:
            raise GatewayCallError(f"route {model!r} changed dimension mid-index "
                                   f"({parts[0].shape[1]} then {part.shape[1]})")
        parts.append(part)
        advance(len(part))
    return np.concatenate(parts)


def _progress() -> Progress:
    """A bar on stderr while embedding (none in --json mode or off a terminal)."""
    return Progress(TextColumn("embedding [bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("chunks"), TimeElapsedColumn(), console=err_console, transient=True,
                    disable=Ctx.json or not sys.stderr.isatty())


def _note_skipped(skipped: list[tuple[str, str]]) -> None:
    """One note per file, or per reason when several files share it (a code tree's .py files)."""
    by_reason: dict[str, list[str]] = {}
    for label, reason in skipped:
        by_reason.setdefault(reason, []).append(label)
    for reason, labels in by_reason.items():
        if len(labels) == 1:
            _note(f"skipped {labels[0]}: {reason}")
        else:
            shown = ", ".join(labels[:NOTE_EXAMPLES]) + (", …" if len(labels) > NOTE_EXAMPLES else "")
            _note(f"skipped {len(labels)} files, {reason}: {shown}")


def _note(message: str) -> None:
    if not Ctx.json:
        err_console.print(f"[yellow]note:[/] {escape(message)}", highlight=False, soft_wrap=True)


@app.command()
def index(
    path: Annotated[Path, typer.Argument(help="A text or markdown file, or a folder read recursively.",
                                         exists=True, readable=True)],
    collection: Annotated[str, typer.Option(help="Collection to build (replaced whole if it exists).")],
    model: Annotated[str, typer.Option(help="Embeddings route of the gateway.")] = "minilm",
    chunk_chars: Annotated[int, typer.Option(help="Longest chunk in characters (the embedder reads "
                                             "~256 tokens).", min=100, max=8000)] = 600,
    overlap: Annotated[int, typer.Option(help="Characters a chunk repeats from the one before it.",
                                         min=0)] = 80,
    batch_size: Annotated[int, typer.Option(help="Chunks per embeddings request.", min=1, max=2048)] = 32,
    key: Annotated[str, typer.Option(help="Virtual key; default: the admin key (EXAMLOPS_ADMIN_KEY).")] = "",
) -> None:
    """Chunk the .md/.markdown/.mdx/.txt/.text/.rst files under PATH and embed them through the gateway.

    Other files are skipped with a note. Chunks follow headings and paragraphs.

    The collection is replaced atomically: if anything fails, the previous build stays as it was.
    """
    try:
        check_name(collection)
    except CollectionError as exc:
        fail(str(exc))
    if overlap * 2 > chunk_chars:
        fail(f"--overlap {overlap} is more than half of --chunk-chars {chunk_chars}")
    files, skipped = collect_files(path)
    _note_skipped(skipped)
    if not files:
        fail(f"no text or markdown files at {path} (read: {', '.join(sorted(TEXT_SUFFIXES))})")

    records: list[dict[str, Any]] = []
    inputs: list[str] = []
    sources: list[dict[str, Any]] = []
    for f in files:
        chunks = chunk_text(f.text, chunk_chars, overlap)
        sources.append({"path": f.label, "sha256": f.sha256, "bytes": f.size, "chunks": len(chunks)})
        for position, c in enumerate(chunks, start=1):
            records.append({"id": len(records), "source": f.label, "chunk": position, "of": len(chunks),
                            "line": c.line, "section": c.section, "text": c.text})
            inputs.append(embedding_input(f.label, c))

    with _progress() as bar:
        task = bar.add_task(collection, total=len(inputs))
        try:
            vectors = _embed_all(inputs, model, key or None, batch_size,
                                 lambda n: bar.update(task, advance=n))
        except GatewayCallError as exc:
            fail(f"embedding through route {model!r} failed, collection {collection!r} unchanged: {exc}")

    meta = {"collection": collection, "embedding_model": model, "dimension": int(vectors.shape[1]),
            "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "gateway_url": Ctx.settings().gateway_url, "root": str(path.resolve()),
            "chunk_chars": chunk_chars, "overlap": overlap, "chunks": len(records), "sources": sources,
            "skipped": [{"path": label, "reason": reason} for label, reason in skipped]}
    where = write_collection(collection, meta, records, vectors)
    if Ctx.json:
        emit_json({**meta, "path": str(where)})
        return
    files_text = f"{len(files)} file" + ("s" if len(files) != 1 else "")
    console.print(f"indexed {files_text} as {len(records)} chunks ({vectors.shape[1]}-dimensional, route {model}) "
                  f"into collection [bold]{collection}[/] at {escape(str(where))}", highlight=False)


def _no_answer(reason: str, collection: str) -> NoReturn:
    if Ctx.json:
        emit_json({"answer": None, "collection": collection, "error": reason, "sources": []})
    else:
        console.print("(no answer)", highlight=False, markup=False)
    fail(reason)


def build_messages(question: str, hits: list[dict[str, Any]]) -> list[dict[str, str]]:
    passages = "\n\n".join(f"[{n}] {_label(h)}\n{h['text']}" for n, h in enumerate(hits, start=1))
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Context:\n\n{passages}\n\nQuestion: {question}"}]


def _label(hit: dict[str, Any]) -> str:
    section = f", § {hit['section']}" if hit.get("section") else ""
    return f"{hit['source']} (chunk {hit['chunk']} of {hit['of']}, line {hit['line']}{section})"


@app.command()
def query(
    question: Annotated[str, typer.Argument(help="The question, in quotes.")],
    collection: Annotated[str, typer.Option(help="Collection built by `exa rag index`.")],
    model: Annotated[str, typer.Option(help="Chat route that writes the answer.")] = "default",
    k: Annotated[int, typer.Option("-k", "--top-k", help="Chunks given to the model as context.",
                                   min=1, max=50)] = 4,
    max_tokens: Annotated[int, typer.Option(help="Longest answer in tokens.", min=1)] = 256,
    key: Annotated[str, typer.Option(help="Virtual key; default: the admin key (EXAMLOPS_ADMIN_KEY).")] = "",
) -> None:
    """Answer QUESTION from the collection's most similar chunks, then list those sources with scores.

    The question is embedded with the route the collection was built with.

    A failed gateway call (gateway down, model not found, engine error): `(no answer)`, the reason, exit 1.
    """
    try:
        coll = load_collection(check_name(collection))
    except CollectionError as exc:
        fail(str(exc))
    route = coll.meta["embedding_model"]
    try:
        q = embed([question], route, key or None)[0]
        if q.shape[0] != coll.vectors.shape[1]:
            raise GatewayCallError(f"route {route!r} now embeds in {q.shape[0]} dimensions, the collection "
                                   f"in {coll.vectors.shape[1]}: rebuild it with `exa rag index`")
        hits = [{**coll.chunks[i], "score": round(score, 4)} for i, score in top_k(coll.vectors, q, k)]
        obj = _post("/v1/chat/completions", {"model": model, "messages": build_messages(question, hits),
                                             "max_tokens": max_tokens, "temperature": 0}, key or None)
        answer = ((obj.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
        if not answer.strip():
            raise GatewayCallError(f"route {model!r} returned an empty answer")
    except GatewayCallError as exc:
        _no_answer(str(exc), collection)
    sources = [{"rank": n, "source": h["source"], "chunk": h["chunk"], "of": h["of"], "line": h["line"],
                "section": h["section"], "score": h["score"]} for n, h in enumerate(hits, start=1)]
    if Ctx.json:
        emit_json({"answer": answer, "model": model, "collection": collection, "sources": sources,
                   "usage": obj.get("usage")})
        return
    console.print(answer.strip(), highlight=False, markup=False, soft_wrap=True)
    console.print("\nSources:", highlight=False, markup=False)
    for n, h in enumerate(hits, start=1):
        console.print(f"  [{n}] {_label(h)}  score {h['score']:.3f}", highlight=False, markup=False,
                      soft_wrap=True)


@app.command("list")
def list_() -> None:
    """Collections with their chunks, source files, embedding route and when they were built."""
    rows = list_collections()
    if Ctx.json:
        emit_json(rows)
        return
    if not rows:
        console.print(f"no collections in {rag_root()} (build one with `exa rag index PATH --collection NAME`)",
                      highlight=False, markup=False)
        return
    table("RAG collections", ["collection", "chunks", "files", "embedding route", "dimension", "built", "from"],
          [[r["collection"], r.get("chunks"), len(r.get("sources") or []), r.get("embedding_model"),
            r.get("dimension"), r.get("created_at"), r.get("root")] for r in rows])
