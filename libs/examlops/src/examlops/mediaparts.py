"""What counts as media in OpenAI chat messages, for every service that has to decide.

Engine-proxy asks `has_media` whether a request needs the mediaguard hop; mediaguard validates
with the same vocabulary. One definition, so the cheap check can never skip a part that the
validator would have judged.
"""

from __future__ import annotations

from typing import Any, Final

TEXT_PART_TYPES: Final = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
#: The other part types vLLM 0.32 parses (MM_PARSER_MAP of renderers/chat_utils.py): media, whose
#: prompt tokens are not their bytes. Every other type is unknown to the engine.
MEDIA_PART_TYPES: Final = frozenset({
    "image_url", "input_image", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil",
    "audio_url", "input_audio", "video_url",
})
#: Fields an engine may read media from, whatever the part's declared type.
MEDIA_FIELDS: Final = frozenset({
    "image_url", "input_audio", "audio_url", "video_url", "image_embeds", "audio_embeds", "video_embeds",
    "prompt_embeds", "image_pil", "uuid",
})


def is_text_type(part_type: Any) -> bool:
    return isinstance(part_type, str) and part_type in TEXT_PART_TYPES


def is_plain_text(part: dict[str, Any]) -> bool:
    return is_text_type(part.get("type")) and MEDIA_FIELDS.isdisjoint(part)


def has_media(messages: Any) -> bool:
    """Whether `messages` need validating: True unless every part is plainly text.

    When in doubt (malformed shapes, unknown part types) the answer is True, because a False
    skips validation altogether.
    """
    if not isinstance(messages, list):
        return True
    for message in messages:
        if not isinstance(message, dict):
            return True
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            return True
        for part in content:
            if isinstance(part, str):
                continue
            if not isinstance(part, dict) or not is_plain_text(part):
                return True
    return False
