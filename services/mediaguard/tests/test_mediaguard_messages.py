"""validate_messages, has_media and strip_media as the gateway sees them: shapes, kinds, limits."""

from __future__ import annotations

import base64
import copy
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest

from examlops.engine import MultimodalPolicy
from examlops_mediaguard._validate import (
    REJECTION_CODES,
    MediaRejected,
    has_media,
    strip_media,
    validate_messages,
)
from examlops_testsupport.media_corpus import (
    ALLOWED,
    HOSTILE,
    JPEG,
    MP4,
    PNG,
    POLICY_KWARGS,
    WAV,
    data_url,
    image,
    make_media_root,
    request,
)

POLICY = MultimodalPolicy(**POLICY_KWARGS)
TEXT = {"type": "text", "text": "describe"}


def policy(**overrides: Any) -> MultimodalPolicy:
    return MultimodalPolicy(**{**POLICY_KWARGS, **overrides})


def refusal(messages: Any, pol: MultimodalPolicy = POLICY) -> MediaRejected:
    with pytest.raises(MediaRejected) as caught:
        validate_messages(messages, pol)
    assert caught.value.code in REJECTION_CODES
    return caught.value


def audio(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": fmt}}


def test_text_only_requests_have_no_media() -> None:
    assert not has_media([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])
    assert not has_media([{"role": "user", "content": [TEXT, "bare", {"type": "refusal"}]}])


@pytest.mark.parametrize(
    "messages",
    [
        request(image("http://example.com/a.png")),
        request({"type": "text", "text": "x", "image_url": "http://127.0.0.1/"}),
        request({"type": "mystery"}),
        request({"image_url": "http://example.com/a.png"}),
        request(7),
        [{"role": "user", "content": {"type": "image_url"}}],
        ["not a message"],
        "not a list",
    ],
)
def test_anything_not_plainly_text_counts_as_media(messages: Any) -> None:
    # A False here skips validation, so doubt must answer True.
    assert has_media(messages)


def test_strip_media_keeps_text_and_counts_what_it_dropped() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [TEXT, image("http://example.com/a.png"), audio(WAV), "bare"]},
        {"role": "user", "content": [{"type": "text", "text": "x", "uuid": "u", "image_url": "i"}]},
    ]
    before = copy.deepcopy(messages)
    stripped, dropped = strip_media(messages)
    assert dropped == 3
    assert stripped[0] == {"role": "system", "content": "be brief"}
    assert stripped[1]["content"] == [TEXT, "bare"]
    assert stripped[2]["content"] == [{"type": "text", "text": "x"}]
    assert messages == before
    assert not has_media(stripped)


def test_validation_returns_new_messages_and_leaves_the_input_alone() -> None:
    messages = request({"type": "image_url", "image_url": "HTTP://EXAMPLE.COM:80/a.png"})
    before = copy.deepcopy(messages)
    result = validate_messages(messages, POLICY)
    assert messages == before
    assert result.messages[0]["content"][1] == image("http://example.com/a.png")
    result.messages[0]["content"][0]["text"] = "changed"
    result.messages[0]["content"].append("more")
    assert messages == before


def test_media_parts_are_rebuilt_from_checked_fields_only() -> None:
    part = {
        "type": "image_url",
        "image_url": {"url": "https://example.com/a.png", "detail": "auto", "extra": "x"},
        "cache_control": {"type": "ephemeral"},
    }
    result = validate_messages(request(part), POLICY)
    expected = {
        "type": "image_url",
        "image_url": {"url": "https://example.com/a.png", "detail": "auto"},
    }
    assert result.messages[0]["content"][1] == expected


def test_counts_add_up_across_messages_and_report_per_kind() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [image("http://example.com/1.png")]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [TEXT, image(data_url("image/png", PNG))]},
    ]
    result = validate_messages(messages, POLICY)
    assert result.counts == {"image": 2} and result.media_parts == 2


def test_rejection_names_message_and_part() -> None:
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "user", "content": [TEXT, TEXT, image("http://169.254.169.254/")]},
    ]
    rejected = refusal(messages)
    assert (rejected.code, rejected.param, rejected.part_index) == (
        "media_ip_literal_not_allowed",
        "messages[1].content[2]",
        2,
    )
    assert str(rejected).startswith("media_ip_literal_not_allowed: ")
    assert pickle.loads(pickle.dumps(rejected)).param == "messages[1].content[2]"


def test_rejection_messages_stay_short_whatever_the_input() -> None:
    rejected = refusal(request(image("http://example.com/" + "\x00" * 3000)))
    assert len(rejected.message) < 200


def test_empty_allow_list_denies_every_remote_url_but_not_inline_data() -> None:
    closed = policy(allowed_media_domains=[])
    assert refusal(request(image("https://example.com/a.png")), closed).code == ("media_domain_not_allowed")
    assert validate_messages(request(image(data_url("image/png", PNG))), closed).counts == {"image": 1}


def test_allow_list_entries_are_normalised_and_junk_entries_match_nothing() -> None:
    # The policy schema refuses such entries; the validator must still fail closed on a policy
    # that skipped validation (model_construct, an older registry record).
    domains = [" IMG.Example.COM. ", "*.evil.net", "", "."]
    pol = MultimodalPolicy.model_construct(**{**POLICY_KWARGS, "allowed_media_domains": domains})
    url = validate_messages(request(image("https://a.img.example.com/x.png")), pol)
    assert url.messages[0]["content"][1]["image_url"]["url"] == "https://a.img.example.com/x.png"
    for host in ("example.com", "evil.net", "a.evil.net", "x.com"):
        rejected = refusal(request(image(f"https://{host}/x.png")), pol)
        assert rejected.code == "media_domain_not_allowed"


def test_ip_entries_in_the_allow_list_do_not_admit_ip_hosts() -> None:
    pol = policy(allowed_media_domains=["10.0.0.5", "example.com"])
    rejected = refusal(request(image("http://10.0.0.5/a.png")), pol)
    assert rejected.code == "media_ip_literal_not_allowed"


def test_text_endpoint_refuses_media_but_passes_text() -> None:
    text_only = MultimodalPolicy()
    assert validate_messages(request(TEXT), text_only).counts == {}
    assert refusal(request(image("https://example.com/a.png")), text_only).code == ("media_modality_not_supported")


def test_video_endpoint_takes_video_and_images_within_their_own_limits() -> None:
    video = policy(modality="video", limit_mm_per_prompt={"video": 1, "image": 1})
    mp4 = {"type": "video_url", "video_url": {"url": data_url("video/mp4", MP4)}}
    messages = [{"role": "user", "content": [mp4, image(data_url("image/jpeg", JPEG))]}]
    assert validate_messages(messages, video).counts == {"video": 1, "image": 1}
    assert refusal([{"role": "user", "content": [mp4, mp4]}], video).code == "media_count_exceeded"


def test_a_served_kind_without_a_limit_entry_is_not_allowed() -> None:
    video_only_limit = policy(modality="video", limit_mm_per_prompt={"video": 4})
    rejected = refusal(request(image("https://example.com/a.png")), video_only_limit)
    assert rejected.code == "media_count_exceeded" and "0" in rejected.message


def test_audio_endpoint_checks_input_audio_like_a_data_url() -> None:
    pol = policy(modality="audio", limit_mm_per_prompt={"audio": 3})
    ok = validate_messages(request(audio(WAV, "WAV")), pol)
    assert ok.messages[0]["content"][1]["input_audio"]["format"] == "wav"
    mp3 = validate_messages(request(audio(b"ID3\x04\x00" + bytes(20), "mp3")), pol)
    assert mp3.counts == {"audio": 1}
    assert refusal(request(audio(WAV, "flac")), pol).code == "media_type_not_allowed"
    assert refusal(request(audio(WAV, "wav;base64,AAAA")), pol).code == "media_type_not_allowed"
    assert refusal(request(audio(PNG, "wav")), pol).code == "media_encoding_mismatch"
    big = WAV + bytes(POLICY_KWARGS["max_image_bytes"])
    assert refusal(request(audio(big)), pol).code == "media_too_large"
    url = {"type": "audio_url", "audio_url": data_url("audio/mp3", b"ID3" + bytes(9))}
    forwarded = validate_messages(request(url), pol).messages[0]["content"][1]
    assert forwarded["audio_url"]["url"].startswith("data:audio/mpeg;base64,")


def test_local_media_needs_the_root_mounted_here(tmp_path: Path) -> None:
    unmounted = policy(allowed_local_media_path=str(tmp_path / "not-mounted"))
    rejected = refusal(request(image(f"file://{tmp_path}/not-mounted/a.png")), unmounted)
    assert rejected.code == "media_path_not_allowed"


def test_root_given_through_a_symlink_is_resolved_before_the_containment_check(
    tmp_path: Path,
) -> None:
    root = make_media_root(tmp_path)
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    pol = policy(allowed_local_media_path=str(alias))
    result = validate_messages(request(image(f"file://{alias}/sub/b.jpg")), pol)
    expected = f"file://{os.path.realpath(root)}/sub/b.jpg"
    assert result.messages[0]["content"][1]["image_url"]["url"] == expected
    assert refusal(request(image(f"file://{alias}/../secret.png")), pol).code == ("media_path_not_allowed")


def test_validation_never_touches_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network call during validation: {args!r}")

    for name in ("getaddrinfo", "gethostbyname", "create_connection"):
        monkeypatch.setattr(socket, name, no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    for part, _ in ALLOWED:
        validate_messages(request(part), POLICY)
    for _, part, _ in HOSTILE:
        with pytest.raises(MediaRejected):
            validate_messages(request(part), POLICY)
