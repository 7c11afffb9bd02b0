"""Hostile and allowed media parts, kept as data so every layer that wires mediaguard reuses them.

``HOSTILE``, ``ALLOWED`` and ``HOSTILE_REQUESTS`` assume a policy built from ``POLICY_KWARGS``.
Local-file entries need a real directory tree: build one with ``make_media_root(tmp_path)`` and
get its entries, and the policy kwargs they assume, from ``corpus(root)``.

Wrap a single part with ``request(part)``: it lands at ``PART_PARAM`` (after one text part), so a
rejection must name ``messages[0].content[1]`` and ``part_index == 1``.
"""

from __future__ import annotations

import base64
import os
import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

Part = dict[str, Any]
Hostile = tuple[str, Any, str]  # (class, part, expected code); a part may be deliberately not a dict
Allowed = tuple[Any, str | None]  # (part, expected forwarded URL, None for text)

MAX_BYTES = 64 * 1024
POLICY_KWARGS: dict[str, Any] = {
    "modality": "vision",
    "limit_mm_per_prompt": {"image": 2},
    "allowed_media_domains": ["example.com"],
    "max_image_bytes": MAX_BYTES,
}
PART_PARAM = "messages[0].content[1]"
PART_INDEX = 1


def request(part: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]


def image(url: str) -> Part:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(mime: str, payload: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


def _png_1x1() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    chunks = chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


PNG = _png_1x1()
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00" + bytes(32) + b"\xff\xd9"
GIF = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"
WEBP = b"RIFF\x1a\x00\x00\x00WEBPVP8 " + bytes(14)
WAV = b"RIFF$\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + bytes(24)
MP4 = b"\x00\x00\x00\x18ftypmp42" + bytes(16)
HTML = b"<html><script>alert(document.cookie)</script></html>"
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"/>'
PNG_B64 = base64.b64encode(PNG).decode()


def _urls(cls: str, code: str, *urls: str) -> list[Hostile]:
    return [(cls, image(url), code) for url in urls]


IP = "media_ip_literal_not_allowed"
MALFORMED = "media_url_malformed"
USERINFO = "media_userinfo_not_allowed"

# fmt: off
HOSTILE: list[Hostile] = [
    *_urls("ip_encoding", IP,
           "http://127.0.0.1/a.png", "http://2130706433/a.png", "http://0177.0.0.1/a.png",
           "http://017700000001/", "http://0x7f.1/a.png", "http://0x7f000001/", "http://127.1/",
           "http://0/", "http://169.254.169.254/latest/meta-data/", "http://0xA9.0xFE.0xA9.0xFE/",
           "https://10.0.0.1:443/", "HTTP://192.168.0.1/", "http://[::1]/a.png", "http://[::]/",
           "http://[::ffff:127.0.0.1]/", "http://[::ffff:a9fe:a9fe]/",
           "http://[0:0:0:0:0:ffff:7f00:1]/", "http://[fe80::1%25eth0]/",
           "http://example.com.127.0.0.1/"),
    *_urls("userinfo_fragment", USERINFO,
           "http://user@example.com/a.png", "http://@example.com/a.png",
           "http://user:pass@example.com/", "http://example.com@evil.com/a.png",
           "http://example.com:80@evil.com/", "http://evil.com?@example.com/",
           "http://evil.com/?@example.com", "http://example.com%2f@evil.com/"),
    *_urls("userinfo_fragment", MALFORMED,
           "http://evil.com#@example.com/", "http://example.com/a.png#frag",
           "https://example.com/a.png?x=1#@evil.com"),
    *_urls("backslash_differential", MALFORMED,
           "http://evil.com\\@example.com/", "http://example.com\\.evil.com/",
           "http:\\\\example.com\\a.png", "http:/\\example.com/", "http:/example.com/a.png",
           "http:example.com/a.png", "http:///example.com/a.png", "//example.com/a.png",
           "example.com/a.png", "http://example.com:80:80/", "http://evil.com;example.com/",
           "http://example.com/<script>", "http://example.com/a.png?q=\"x\""),
    *_urls("whitespace_control", MALFORMED,
           "http://exam\tple.com/", "http://example.com/a.png\n", "http://exa\rmple.com/",
           " http://example.com/a.png", "http://example.com/a b.png",
           "http://example.com\x00.evil.com/", "http://evil.com\x0b/", "http://example.com/\x7f"),
    *_urls("percent_unicode", MALFORMED,
           "http://%65xample.com/", "http://example%2ecom/", "http://ex%61mple.com/a.png",
           "http://ex\u0430mple.com/", "http://example\u3002com/", "http://example\uff0ecom/",
           "http://\uff45\uff58\uff41\uff4d\uff50\uff4c\uff45.com/", "http://example.com\u200b/",
           "http://xn--exmple-cua.com/", "http://xn--80ak6aa92e.example.com/",
           "http://EXAMPLE.\u0130O/"),
    *_urls("trailing_dot", MALFORMED,
           "http://example.com./a.png", "http://cdn.example.com../", "http://.example.com/",
           "http://example..com/", "http://127.0.0.1./"),
    *_urls("suffix_lookalike", "media_domain_not_allowed",
           "http://notexample.com/a.png", "http://example.com.evil.net/a.png",
           "http://evilexample.com/", "http://example.co/", "http://example.com-evil.net/",
           "http://example.comm/", "http://com/", "http://localhost/a.png",
           "http://metadata.google.internal/computeMetadata/v1/"),
    *_urls("odd_port", "media_port_not_allowed",
           "http://example.com:8080/a.png", "http://example.com:443/", "https://example.com:80/",
           "http://example.com:/", "http://example.com:080/", "http://example.com:+80/",
           "http://example.com:65616/", "https://example.com:0/"),
    *_urls("scheme", "media_scheme_not_allowed",
           "ftp://example.com/a.png", "gopher://example.com:70/_GET%20/", "file:///etc/passwd",
           "file:///data/media/a.png", "javascript:alert(1)", "jar:http://example.com/a.jar!/a.png",
           "dict://example.com:11211/stat", "ws://example.com/", "blob:https://example.com/1",
           "netdoc:///etc/passwd", "ldap://example.com/"),
    ("data_type", image(data_url("text/html", HTML)), "media_type_not_allowed"),
    ("data_type", image(data_url("image/svg+xml", SVG)), "media_type_not_allowed"),
    ("data_type", image(data_url("application/octet-stream", PNG)), "media_type_not_allowed"),
    ("data_type", image(data_url("image/bmp", b"BM" + bytes(30))), "media_type_not_allowed"),
    ("data_type", image(data_url("audio/wav", WAV)), "media_type_not_allowed"),
    ("data_type", image(data_url("video/mp4", MP4)), "media_type_not_allowed"),
    ("data_type", image("data:image/png;charset=utf-8;base64," + PNG_B64),
     "media_type_not_allowed"),
    ("data_type", image("data:;base64," + PNG_B64), "media_type_not_allowed"),
    ("data_lying", image(data_url("image/jpeg", PNG)), "media_encoding_mismatch"),
    ("data_lying", image(data_url("image/png", JPEG)), "media_encoding_mismatch"),
    ("data_lying", image(data_url("image/gif", PNG)), "media_encoding_mismatch"),
    ("data_lying", image(data_url("image/webp", WAV)), "media_encoding_mismatch"),
    ("data_lying", image(data_url("image/png", HTML)), "media_encoding_mismatch"),
    ("data_lying", image("data:image/png," + PNG.decode("latin-1")), "media_encoding_mismatch"),
    ("data_lying", image("data:image/png;base64,not*base64!!"), "media_encoding_mismatch"),
    ("data_lying", image("data:image/png;base64," + PNG_B64[:-1]), "media_encoding_mismatch"),
    ("data_lying", image("data:image/png;base64," + PNG_B64 + "@@@@"), "media_encoding_mismatch"),
    ("data_lying", image("data:image/png;base64,"), "media_encoding_mismatch"),
    ("data_lying", image("data:image/png;base64," + PNG_B64[:-4] + "===="),
     "media_encoding_mismatch"),
    ("oversized", image(data_url("image/png", PNG + bytes(MAX_BYTES))), "media_too_large"),
    ("oversized", image("data:image/png;base64," + "A" * 400_000), "media_too_large"),
    ("oversized", image("data:image/png;base64," + "A" * 87_383 + "="), "media_too_large"),
    ("part_shape", {"image_url": "http://example.com/a.png"}, "media_part_malformed"),
    ("part_shape", {"type": "text", "text": "hi", "uuid": "u1", "image_url": "http://127.0.0.1/"},
     "media_part_malformed"),
    ("part_shape", {"type": "text", "text": "hi", "image_url": {"url": "http://127.0.0.1/"}},
     "media_part_malformed"),
    ("part_shape", {**image("http://example.com/a.png"), "uuid": "another-tenants-image"},
     "media_part_malformed"),
    ("part_shape", {**image("http://example.com/a.png"), "video_url": {"url": "http://evil/"}},
     "media_part_malformed"),
    ("part_shape", {"type": "image_url", "image_url": {"url": 123}}, "media_part_malformed"),
    ("part_shape", {"type": "image_url", "image_url": {}}, "media_part_malformed"),
    ("part_shape", {"type": "image_url", "image_url": ["http://example.com/"]},
     "media_part_malformed"),
    ("part_shape", {"type": "image_url", "image_url": {"url": "http://example.com/", "detail": 9}},
     "media_part_malformed"),
    ("part_shape", {"type": ["image_url"], "image_url": "http://example.com/"},
     "media_part_malformed"),
    ("part_shape", 42, "media_part_malformed"),
    ("part_type", {"type": "image_embeds", "image_embeds": "gASVAAAA"}, "media_type_not_allowed"),
    ("part_type", {"type": "prompt_embeds", "data": "gASVAAAA"}, "media_type_not_allowed"),
    ("part_type", {"type": "image_pil", "image_pil": None}, "media_type_not_allowed"),
    ("part_type", {"type": "file", "file": {"file_id": "file-1"}}, "media_type_not_allowed"),
    ("part_type", {"type": "image", "url": "http://example.com/a.png"}, "media_type_not_allowed"),
    ("modality", {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV).decode(),
                                                         "format": "wav"}},
     "media_modality_not_supported"),
    ("modality", {"type": "audio_url", "audio_url": {"url": "http://example.com/a.wav"}},
     "media_modality_not_supported"),
    ("modality", {"type": "video_url", "video_url": {"url": "http://example.com/a.mp4"}},
     "media_modality_not_supported"),
]
# fmt: on


def _two_images_then(extra: Part) -> list[dict[str, Any]]:
    two = [image("http://example.com/1.png"), image(data_url("image/png", PNG))]
    return [{"role": "user", "content": [*two, extra]}]


#: Whole requests: (class, messages, expected code, expected param).
# fmt: off
HOSTILE_REQUESTS: list[tuple[str, list[Any], str, str]] = [
    ("too_many_parts", _two_images_then(image("http://example.com/3.png")),
     "media_count_exceeded", "messages[0].content[2]"),
    ("too_many_parts", [{"role": "user", "content": [image("http://example.com/1.png")]},
                        {"role": "assistant", "content": "a cat"},
                        {"role": "user", "content": [image("http://example.com/2.png"),
                                                     {"type": "text", "text": "and"},
                                                     image("http://example.com/3.png")]}],
     "media_count_exceeded", "messages[2].content[2]"),
    ("too_many_parts", _two_images_then({"type": "image_url", "image_url": "http://example.com/"}),
     "media_count_exceeded", "messages[0].content[2]"),
    ("message_shape", [{"role": "user", "content": {"type": "image_url"}}],
     "media_part_malformed", "messages[0].content"),
    ("message_shape", ["not a message"], "media_part_malformed", "messages[0]"),
]
# fmt: on

# fmt: off
ALLOWED: list[Allowed] = [
    (image("http://example.com/a.png"), "http://example.com/a.png"),
    (image("https://example.com/a.png"), "https://example.com/a.png"),
    (image("http://img.example.com/a.png"), "http://img.example.com/a.png"),
    (image("https://a.b-c.example.com/x/y.jpg?sig=ab%2Fc&x=1"),
     "https://a.b-c.example.com/x/y.jpg?sig=ab%2Fc&x=1"),
    (image("HTTP://IMG.EXAMPLE.COM/A.PNG"), "http://img.example.com/A.PNG"),
    (image("https://Example.Com"), "https://example.com/"),
    (image("http://example.com:80/a.png"), "http://example.com/a.png"),
    (image("https://example.com:443/a.png"), "https://example.com/a.png"),
    (image("https://cdn.example.com/a%20b.png"), "https://cdn.example.com/a%20b.png"),
    (image("http://example.com/a.png?"), "http://example.com/a.png"),
    (image("http://example.com?x=1"), "http://example.com/?x=1"),
    (image("http://1-2.example.com/a.png"), "http://1-2.example.com/a.png"),
    (image("http://127.0.0.1.example.com/a.png"), "http://127.0.0.1.example.com/a.png"),
    ({"type": "image_url", "image_url": "https://example.com/a.png"}, "https://example.com/a.png"),
    ({"type": "input_image", "image_url": "https://example.com/b.png", "detail": "low"},
     "https://example.com/b.png"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "high"}},
     "https://example.com/a.png"),
    (image(data_url("image/png", PNG)), data_url("image/png", PNG)),
    (image(data_url("image/jpeg", JPEG)), data_url("image/jpeg", JPEG)),
    (image(data_url("image/gif", GIF)), data_url("image/gif", GIF)),
    (image(data_url("image/webp", WEBP)), data_url("image/webp", WEBP)),
    (image(data_url("image/jpg", JPEG)), data_url("image/jpeg", JPEG)),
    (image("DATA:IMAGE/PNG;BASE64," + PNG_B64), "data:image/png;base64," + PNG_B64),
    (image(data_url("image/png", PNG + bytes(MAX_BYTES - len(PNG)))),
     data_url("image/png", PNG + bytes(MAX_BYTES - len(PNG)))),
    ({"type": "text", "text": "hello"}, None),
    ({"type": "input_text", "text": "hello", "cache_control": {"type": "ephemeral"}}, None),
    ("a bare string part", None),
]
# fmt: on


class Corpus(NamedTuple):
    hostile: list[Hostile]
    allowed: list[Allowed]
    policy_kwargs: dict[str, Any]


def make_media_root(base: Path) -> Path:
    """Build ``base/media`` (the root) and the files around it that the local corpus refers to."""
    root = base / "media"
    (root / "sub").mkdir(parents=True)
    (base / "outside").mkdir()
    (base / "media-evil").mkdir()
    # fmt: off
    for path, payload in [
        (root / "a.png", PNG), (root / "sub" / "b.jpg", JPEG), (root / "name with space.png", PNG),
        (root / "caf\u00e9.png", PNG), (root / "notes.txt", b"just text\n"),
        (root / "big.png", PNG + bytes(MAX_BYTES)), (base / "secret.png", PNG),
        (base / "outside" / "secret.png", PNG), (base / "media-evil" / "a.png", PNG),
    ]:
        path.write_bytes(payload)
    # fmt: on
    (root / "link-inside.png").symlink_to("a.png")
    (root / "link-out.png").symlink_to(base / "secret.png")
    (root / "dirlink").symlink_to(base / "outside", target_is_directory=True)
    os.mkfifo(root / "pipe.png")
    return root


def corpus(root: Path) -> Corpus:
    """Local-file entries for a root made by `make_media_root`, and the policy they assume."""
    url = "file://" + quote(str(root))
    real = "file://" + quote(os.path.realpath(root))
    path_denied, malformed = "media_path_not_allowed", "media_url_malformed"
    # fmt: off
    hostile: list[Hostile] = [
        *_urls("file_traversal", path_denied, f"{url}/../secret.png",
               f"{url}/sub/../../secret.png", "file:///etc/passwd", f"{url}-evil/a.png",
               f"{url}/missing.png", f"{url}", f"{url}/", f"{url}/.", f"{url}/sub",
               f"{url}/pipe.png"),
        *_urls("file_encoded_traversal", path_denied, f"{url}/%2e%2e/secret.png",
               f"{url}/sub/%2E%2E/%2e%2e/secret.png", f"{url}/.%2e/secret.png",
               f"{url}/..%2fsecret.png", f"{url}/..%5csecret.png", f"{url}/a.png%00.jpg"),
        *_urls("file_symlink", path_denied, f"{url}/link-out.png", f"{url}/dirlink/secret.png"),
        *_urls("file_shape", malformed, f"{url}\\..\\secret.png", f"file://localhost{url[7:]}/a.png",
               "file://evil.com/share/a.png", f"file:{url[7:]}/a.png", f"{url}/a.png?x=1",
               f"{url}/a.png#x", f"{url}/a%zz.png", f"{url}/%ff.png"),
        ("file_content", image(f"{url}/notes.txt"), "media_type_not_allowed"),
        ("file_content", image(f"{url}/big.png"), "media_too_large"),
    ]
    # fmt: on
    allowed: list[Allowed] = [
        (image(f"{url}/a.png"), f"{real}/a.png"),
        (image(f"{url}/sub/b.jpg"), f"{real}/sub/b.jpg"),
        (image(f"{url}/sub/../a.png"), f"{real}/a.png"),
        (image(f"{url}/./a.png"), f"{real}/a.png"),
        (image(f"{url}/%61.png"), f"{real}/a.png"),
        (image(f"{url}/link-inside.png"), f"{real}/a.png"),
        (image(f"{url}/name%20with%20space.png"), f"{real}/name%20with%20space.png"),
        (image(f"{url}/caf%C3%A9.png"), f"{real}/caf%C3%A9.png"),
    ]
    kwargs = {**POLICY_KWARGS, "allowed_local_media_path": str(root)}
    return Corpus(hostile, allowed, kwargs)
