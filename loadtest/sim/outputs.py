"""How many tokens a request generates.

With `ignore_eos` it generates exactly `max_tokens`, as vLLM does, so a load test can demand exact
output lengths. Otherwise the "model" stops at an EOS drawn from a log-normal length distribution
shaped like chat answers in ShareGPT (median 150 tokens, sigma 0.9: mean ~225, p90 ~480), then
clamped to [max(min_tokens, 1), max_tokens]. A request that reaches max_tokens finishes with
"length", one that stops earlier with "stop".
"""

from __future__ import annotations

import math
import random

OUTPUT_LEN_MEDIAN = 150
OUTPUT_LEN_SIGMA = 0.9


class OutputLengths:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._mu = math.log(OUTPUT_LEN_MEDIAN)

    def draw(self, max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False) -> int:
        if ignore_eos:
            return max_tokens
        natural = max(1, round(self._rng.lognormvariate(self._mu, OUTPUT_LEN_SIGMA)))
        return min(max_tokens, max(min_tokens, natural))
