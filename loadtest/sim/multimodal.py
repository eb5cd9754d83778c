"""Image parts of chat messages: taken out of the text the template renders, counted apart.

vLLM serving a vision model turns each image part (`image_url` in chat, `input_image` in the
Responses API; its chat parser takes both) into a placeholder in the rendered prompt that the
processor expands to the image's tokens. The simulated engine has no vision tower and its
tokenizer no placeholders, so an image costs a fixed number of prompt tokens instead (the
`--image-tokens` option): the parts are removed from the messages before the template renders
them, and `count x image_tokens` is added to the rendered prompt's count.

The images still tell prompts apart for prefix caching, as vLLM's multimodal hashes do: each
message's image URLs are kept as short digests, which `keyed()` adds to a copy of the messages
that only the block hashing sees (never the template).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any


class ImageError(ValueError):
    """An image part that names no image; `param` is the request field it is in."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

IMAGE_PARTS = ("image_url", "input_image")
# Text parts under their Responses API names; the template sees them as chat text parts.
TEXT_ALIASES = ("input_text", "output_text")

# (message index, digest of the image's URL), one per image in the order sent.
ImageKeys = tuple[tuple[int, str], ...]


def image_url(part: Mapping[str, Any]) -> str | None:
    """The URL (or data URL, or file id) of an image part; None when it names none."""
    value = part.get("image_url")
    if isinstance(value, Mapping):  # chat: {"image_url": {"url": "..."}}
        value = value.get("url")
    if isinstance(value, str) and value:
        return value
    file_id = part.get("file_id")  # Responses: input_image may name an uploaded file instead
    return file_id if isinstance(file_id, str) and file_id else None


def split_images(messages: Sequence[Mapping[str, Any]],
                 param: str = "messages") -> tuple[list[dict[str, Any]], ImageKeys]:
    """The messages without their image parts (copies only where something changed), and the
    images found. A part of an image type that names no image raises `ImageError`."""
    out: list[dict[str, Any]] = []
    keys: list[tuple[int, str]] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list) or not any(
                isinstance(p, Mapping) and p.get("type") in (*IMAGE_PARTS, *TEXT_ALIASES)
                for p in content):
            out.append(message if isinstance(message, dict) else dict(message))
            continue
        parts: list[Any] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_PARTS:
                url = image_url(part)
                if url is None:
                    raise ImageError(f"{param}[{index}].content: a {kind!r} part must give "
                                     "the image (image_url)", param)
                keys.append((index, hashlib.blake2b(url.encode(), digest_size=8).hexdigest()))
            elif kind in TEXT_ALIASES:
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, tuple(keys)


def keyed(messages: Sequence[Mapping[str, Any]], images: ImageKeys) -> list[Mapping[str, Any]]:
    """The messages as block hashing sees them: each with the digests of its images."""
    if not images:
        return list(messages)
    by_message: dict[int, list[str]] = {}
    for index, digest in images:
        by_message.setdefault(index, []).append(digest)
    return [{**m, "images": by_message[i]} if i in by_message else m
            for i, m in enumerate(messages)]
