"""What `exa rag index` reads: the text and markdown files under a path, cut into bounded chunks.

Chunks follow the document: a heading starts a new chunk and names the section of the chunks under
it, paragraphs are kept whole when they fit, and a paragraph longer than a chunk is cut at lines,
then sentences, then words. Consecutive chunks of a section share `overlap` characters, so a sentence
cut at a boundary is still found whole on one side.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = frozenset({".md", ".markdown", ".mdx", ".txt", ".text", ".rst"})
#: Folders a walk never enters (besides hidden ones): caches and build output, not documents.
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "build", "dist"})
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")
#: Longest section label put in front of a chunk's embedding input (the embedder's window is small).
SECTION_LABEL_CHARS = 100


@dataclass(frozen=True)
class SourceFile:
    path: Path
    label: str  # the path shown as the source: relative to the indexed folder
    text: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Chunk:
    text: str
    section: str
    line: int  # 1-based line of the file where the chunk's first block starts


@dataclass(frozen=True)
class _Block:
    text: str
    line: int
    heading: str = ""


def collect_files(root: Path) -> tuple[list[SourceFile], list[tuple[str, str]]]:
    """The text files at `root` (one file, or a folder walked recursively, leaving out hidden folders
    and SKIPPED_DIRS) and the files passed over, each with the reason."""
    if root.is_file():
        candidates, base = [root], root.parent
    else:
        candidates, base = sorted(_walk(root)), root
    files: list[SourceFile] = []
    skipped: list[tuple[str, str]] = []
    for path in candidates:
        label = path.relative_to(base).as_posix()
        if path.suffix.lower() not in TEXT_SUFFIXES:
            skipped.append((label, f"not a text or markdown file ({path.suffix or 'no extension'})"))
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            skipped.append((label, "binary content"))
            continue
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            skipped.append((label, "not UTF-8 text"))
            continue
        if not text.strip():
            skipped.append((label, "empty"))
            continue
        files.append(SourceFile(path, label, text, hashlib.sha256(data).hexdigest(), len(data)))
    return files, skipped


def _walk(folder: Path) -> list[Path]:
    out: list[Path] = []
    for entry in folder.iterdir():
        if entry.name.startswith(".") or entry.name in SKIPPED_DIRS or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            out.extend(_walk(entry))
        elif entry.is_file():
            out.append(entry)
    return out


def _blocks(text: str) -> list[_Block]:
    """Paragraphs (blank-line separated; a fenced code block stays one block) and headings."""
    blocks: list[_Block] = []
    lines: list[str] = []
    start = 0
    in_fence = False

    def close() -> None:
        body = "\n".join(lines).strip("\n")
        if body.strip():
            blocks.append(_Block(body, start))
        lines.clear()

    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            in_fence = not in_fence
        heading = None if in_fence else _HEADING.match(line)
        if heading:
            close()
            blocks.append(_Block(line.strip(), number, heading=heading.group(2).strip()))
        elif not in_fence and not line.strip():
            close()
        else:
            if not lines:
                start = number
            lines.append(line.rstrip())
    close()
    return blocks


def _split_long(text: str, limit: int) -> list[str]:
    """`text` cut into pieces of at most `limit` characters, at the coarsest boundary that works."""
    for separator in ("\n", _SENTENCE_END, " "):
        units = separator.split(text) if isinstance(separator, re.Pattern) else text.split(separator)
        if len(units) < 2:
            continue
        joiner = "\n" if separator == "\n" else " "
        pieces: list[str] = []
        current = ""
        for unit in units:
            if not unit.strip():
                continue
            candidate = f"{current}{joiner}{unit}" if current else unit
            if len(candidate) <= limit:
                current = candidate
                continue
            if current:
                pieces.append(current)
            if len(unit) <= limit:
                current = unit
            else:
                pieces.extend(_split_long(unit, limit))
                current = ""
        if current:
            pieces.append(current)
        return pieces
    return [text[i:i + limit] for i in range(0, len(text), limit)]


def _tail(text: str, chars: int) -> str:
    """The last `chars` characters of `text`, starting at a word."""
    if chars <= 0 or len(text) <= chars:
        return "" if chars <= 0 else text
    cut = text[-chars:]
    space = cut.find(" ")
    return cut[space + 1:] if 0 <= space < len(cut) - 1 else cut


def chunk_text(text: str, chunk_chars: int, overlap: int) -> list[Chunk]:
    """`text` as chunks of at most `chunk_chars` characters."""
    chunks: list[Chunk] = []
    parts: list[str] = []
    fresh = False  # parts hold more than the previous chunk's overlap
    section, line, heading_chars = "", 1, 0

    def size(extra: str) -> int:
        return sum(len(p) + 2 for p in parts) + len(extra)

    def flush(carry: bool) -> None:
        nonlocal fresh
        if fresh:
            body = "\n\n".join(parts)
            chunks.append(Chunk(body, section, line))
            parts[:] = [_tail(body, overlap)] if carry and overlap else []
        else:
            parts.clear()
        fresh = False

    for block in _blocks(text):
        if block.heading:
            flush(carry=False)
            section, line, heading_chars = block.heading, block.line, 0
            if len(block.text) <= chunk_chars // 2:
                parts.append(block.text)
                heading_chars = len(block.text)
            continue
        # a cut piece leaves room for the heading above it or the overlap carried before it
        limit = chunk_chars - max(overlap, heading_chars) - 2
        for piece in [block.text] if len(block.text) <= chunk_chars else _split_long(block.text, limit):
            if size(piece) > chunk_chars:
                flush(carry=True)
                line = block.line
                if size(piece) > chunk_chars:
                    parts.clear()
            if not fresh and not parts:
                line = block.line
            parts.append(piece)
            fresh = True
    flush(carry=False)
    return chunks


def embedding_input(label: str, chunk: Chunk) -> str:
    """What is embedded for a chunk: its file and section in front of its text, so a question naming
    the topic of a section finds chunks deep inside it."""
    section = chunk.section[:SECTION_LABEL_CHARS]
    head = f"{label} — {section}" if section else label
    return f"{head}\n{chunk.text}"
