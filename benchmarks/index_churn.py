"""The worst event-loop step of a backend's prefix index at a steady size: one table against the
tables by hash that gateway/prefix/index.py cuts a large index into.

A store of a prompt's blocks (64 here, a 1K-token prompt at 16 tokens a block) into a full index
evicts as many; a dict rehashes itself whole every so many inserts and evictions, and that step
holds the loop. Prints, per capacity, the worst and the P99.9 step of each layout and their
ratio. `python benchmarks/index_churn.py [--capacities 120000,1000000]`
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.prefix import index as index_module
from gateway.prefix.index import PrefixIndex


def worst_steps(capacity: int, one_table: bool, rounds: int) -> tuple[float, float]:
    saved = index_module.SHARD_BLOCKS
    if one_table:
        index_module.SHARD_BLOCKS = capacity
    try:
        index = PrefixIndex(capacity)
    finally:
        index_module.SHARD_BLOCKS = saved
    rng = random.Random(1)
    prompts = (capacity // 64) * 2 + rounds  # fill it, then churn through it again
    steps: list[float] = []
    for k in range(prompts):
        hashes = [rng.getrandbits(63) - 2**62 for _ in range(64)]
        t = time.perf_counter()
        index.store(hashes)
        if k >= prompts - rounds:
            steps.append(time.perf_counter() - t)
    steps.sort()
    return steps[-1], steps[int(len(steps) * 0.999)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--capacities", default="30000,120000,1000000")
    args = p.parse_args()
    print("| capacity (blocks) | one table: worst / P99.9 (ms) | tables by hash: worst / P99.9 "
          "(ms) | worst, by hash / one |")
    print("|---|---|---|---|")
    for capacity in (int(c) for c in args.capacities.split(",")):
        rounds = max(2_000, 4 * capacity // 64)  # four capacities of churn: a rehash or two
        one = worst_steps(capacity, True, rounds)
        cut = worst_steps(capacity, False, rounds)
        print(f"| {capacity:,} | {one[0] * 1e3:.2f} / {one[1] * 1e3:.2f} | "
              f"{cut[0] * 1e3:.2f} / {cut[1] * 1e3:.2f} | {cut[0] / one[0]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
