"""What every request that decodes nothing reads alike."""

from __future__ import annotations

from typing import ClassVar


class PrefillOnly:
    """A request that is a prefill alone (embeddings, pooling, a count): nothing is decoded.
    Its API has none of these fields; they are constants, so the pipeline reads every request
    alike."""

    stream: ClassVar[bool] = False
    stream_options: ClassVar[None] = None
    include_usage: ClassVar[bool] = False
    n: ClassVar[None] = None

    @property
    def output_limit(self) -> int | None:
        return 0
