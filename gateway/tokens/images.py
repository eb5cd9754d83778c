"""Image parts of a chat (or Responses) request, and the prompt tokens they will cost.

An engine turns each image into a number of prompt tokens that its vision encoder decides
(Qwen2-VL: one per 28 px square after resizing; LLaVA-1.5: 576 whatever the size). The text
tokenizer cannot count them, so the prompt is counted without its images and each image adds
an estimate by the model's rule (`VisionRule`); the engine's usage reconciles the quota.

Only the size is read of an image, and only from a data URL, from the first bytes of its
header (PNG, GIF, JPEG, WebP): an image behind an http URL is not fetched (the gateway never
reaches out on a caller's behalf) and costs the rule's default.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
_HEADER_B64_CHARS = 64 * 1024  # enough base64 for any header we read (a JPEG's SOF included)


@dataclass(frozen=True, slots=True)
class VisionRule:
    tokens_per_image: int
    patch_px: int | None = None
    max_tokens_per_image: int | None = None

    def tokens(self, size: tuple[int, int] | None) -> int:
        if size is None or self.patch_px is None:
            return self.tokens_per_image
        width, height = size
        tiles = math.ceil(width / self.patch_px) * math.ceil(height / self.patch_px)
        return max(1, min(tiles, self.max_tokens_per_image or tiles))


def split_images(messages: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """The messages without their image parts, and each image's URL (or "" when absent)."""
    out: list[Any] = []
    images: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        kept = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                images.append(_url_of(part))
            else:
                kept.append(part)
        out.append({**message, "content": kept})
    return out, images


def _url_of(part: Mapping[str, Any]) -> str:
    ref = part.get("image_url")
    if isinstance(ref, Mapping):  # chat: {"image_url": {"url": ...}}
        ref = ref.get("url")
    return ref if isinstance(ref, str) else ""


def image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a data-URL image, read off its header; None when unknown."""
    if not url.startswith("data:"):
        return None
    _, _, payload = url.partition(",")
    head = payload[:_HEADER_B64_CHARS]
    head = head[: len(head) - len(head) % 4]
    try:
        data = base64.b64decode(head, validate=False)
    except (binascii.Error, ValueError):
        return None
    return _png(data) or _gif(data) or _jpeg(data) or _webp(data)


def _png(d: bytes) -> tuple[int, int] | None:
    if d[:8] == b"\x89PNG\r\n\x1a\n" and len(d) >= 24:
        w, h = struct.unpack(">II", d[16:24])
        return int(w), int(h)
    return None


def _gif(d: bytes) -> tuple[int, int] | None:
    if d[:6] in (b"GIF87a", b"GIF89a") and len(d) >= 10:
        w, h = struct.unpack("<HH", d[6:10])
        return int(w), int(h)
    return None


def _jpeg(d: bytes) -> tuple[int, int] | None:
    if d[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(d):
        if d[i] != 0xFF:
            return None
        marker = d[i + 1]
        length = struct.unpack(">H", d[i + 2:i + 4])[0]
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE,
                      0xCF):  # start of frame: height, then width
            h, w = struct.unpack(">HH", d[i + 5:i + 9])
            return int(w), int(h)
        i += 2 + length
    return None


def _webp(d: bytes) -> tuple[int, int] | None:
    if d[:4] != b"RIFF" or d[8:12] != b"WEBP" or len(d) < 30:
        return None
    chunk = d[12:16]
    if chunk == b"VP8X":
        w = 1 + int.from_bytes(d[24:27], "little")
        h = 1 + int.from_bytes(d[27:30], "little")
        return w, h
    if chunk == b"VP8 " and d[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", d[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and d[20] == 0x2F:
        bits = int.from_bytes(d[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None
