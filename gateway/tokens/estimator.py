"""The `none` tokenizer: tokens estimated from characters, with a ratio learned online.

Used for a model whose tokenizer is not available to the gateway. The estimate is
`chars x ratio`; every completed request's `usage.prompt_tokens` teaches the ratio (decayed sums,
so the ratio follows a drifting mix of languages) and measures the estimate's relative error,
which the gateway exports as a metric so an operator sees how far off admission decisions are.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.cost.errors import TokenizerError

# English prose is ~4 characters a token for BPE vocabularies of 100K+; code and CJK are denser.
# 0.3 tokens/char sits between, and a few hundred observations replace it.
DEFAULT_TOKENS_PER_CHAR = 0.3


def chat_chars(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> int:
    """Characters a chat request carries: every string in its messages plus the tools' JSON.

    This is the measure the character limit applies to and the `none` estimator multiplies; it
    is cheap (no rendering) so it can run on the event loop before anything else.
    """
    total = 0
    stack: list[Any] = list(messages)
    while stack:
        item = stack.pop()
        kind = type(item)
        # The JSON types by identity first: an ABC's isinstance (Mapping) costs a registry
        # walk per value, most of this function's time on a long history.
        if kind is str:
            total += len(item)
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        elif isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    if tools:
        total += len(json.dumps(list(tools), ensure_ascii=False))
    return total


class ErrorTracker:
    """Relative error of predicted vs observed prompt tokens, for the estimate-error metric."""

    def __init__(self, decay: float = 0.02) -> None:
        self._decay = decay
        self._lock = threading.Lock()
        self.observations = 0
        self.last_relative_error = 0.0
        self.mean_abs_relative_error = 0.0

    def record(self, predicted: float, actual: int) -> float:
        error = (predicted - actual) / actual if actual > 0 else 0.0
        with self._lock:
            self.observations += 1
            self.last_relative_error = error
            # Plain mean over the first observations, then an exponential moving average.
            weight = max(self._decay, 1.0 / self.observations)
            self.mean_abs_relative_error += weight * (abs(error) - self.mean_abs_relative_error)
        return error


class CharRatioEstimator:
    """Tokenizer stand-in for `tokenizer: none`: not exact, learns from the backends' usage."""

    name = "none"
    exact = False

    def __init__(
        self, tokens_per_char: float = DEFAULT_TOKENS_PER_CHAR, half_life: float = 500.0
    ) -> None:
        if not tokens_per_char > 0:
            raise TokenizerError(f"tokens_per_char: must be positive, got {tokens_per_char}")
        # Seed the decayed sums with the prior as if it were ~1000 characters of evidence, so the
        # first few observations move the ratio but do not jerk it around.
        self._chars = 1000.0
        self._tokens = 1000.0 * tokens_per_char
        self._keep = math.exp(math.log(0.5) / half_life)
        self._lock = threading.Lock()
        self.errors = ErrorTracker()

    @property
    def tokens_per_char(self) -> float:
        return self._tokens / self._chars

    def estimate_chars(self, chars: int) -> int:
        """The tokens `chars` characters are estimated to be."""
        return max(1, math.ceil(chars * self.tokens_per_char)) if chars > 0 else 0

    def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> int:
        return self.estimate_chars(chat_chars(messages, tools))

    def count_text(self, text: str) -> int:
        return self.estimate_chars(len(text))

    def count_ids(self, ids: Sequence[int]) -> int:
        return len(ids)

    def encode_text(self, text: str) -> list[int]:
        raise TokenizerError("tokenizer 'none' estimates counts; it cannot encode text")

    def decode(self, ids: Sequence[int]) -> str:
        raise TokenizerError("tokenizer 'none' estimates counts; it cannot decode token ids")

    def observe(self, chars: int, actual_tokens: int) -> float:
        """Learn from one completed request; returns the relative error its estimate had."""
        if chars <= 0 or actual_tokens <= 0:
            return 0.0
        error = self.errors.record(chars * self.tokens_per_char, actual_tokens)
        with self._lock:
            self._chars = self._chars * self._keep + chars
            self._tokens = self._tokens * self._keep + actual_tokens
        return error
