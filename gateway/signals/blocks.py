"""The KV block size each engine reports (vLLM's `cache_config_info{block_size}`), and each
pool's: the grain the engines cache prefixes and allocate KV by.

The pool's `block_size` stays the gateway's unit of account (prompts are hashed in blocks of
it, capacity and reservations are counted in it, prefix indexes are keyed by those hashes);
the engine's block size says which of those blocks are real to the engine. An engine caches a
prefix only in whole blocks of its own size, and allocates whole blocks of it to each
request, so predicted cached tokens are rounded down to the engine's block and reservations
up to it. Keeping the unit and rounding, rather than re-hashing at the engine's size, is what
lets the size change under a running gateway (a first scrape, an engine restarted with
another `--block-size`) without re-keying indexes, turn caches or leases already in the
state backend: chained hashes of a finer block that divides the engine's say exactly the
same thing (a prefix of n engine blocks is cached iff its n x ratio finer blocks are).
Until an engine has been scraped, the pool's `block_size` stands for its engine's.
"""

from __future__ import annotations


class EngineBlocks:
    """The block sizes engines reported, by (pool, backend), and the largest per pool: a
    request's reservation is taken before its backend is chosen, so it rounds to the
    largest block of the pool (never short on any backend)."""

    __slots__ = ("backends", "pools")

    def __init__(self) -> None:
        self.backends: dict[tuple[str, str], int] = {}
        self.pools: dict[str, int] = {}

    def report(self, pool: str, backend: str, size: int) -> bool:
        """An engine's block size, scraped; True when it is new or changed."""
        key = (pool, backend)
        if self.backends.get(key) == size:
            return False
        self.backends[key] = size
        self.pools[pool] = max(s for (p, _), s in self.backends.items() if p == pool)
        return True

    def of(self, pool: str, backend: str, fallback: int) -> int:
        return self.backends.get((pool, backend), fallback)

    def pool(self, pool: str, fallback: int) -> int:
        return self.pools.get(pool, fallback)

    def reported(self, pool: str) -> dict[str, int]:
        return {b: s for (p, b), s in self.backends.items() if p == pool}


def disagreement(block_size: int, engines: dict[str, int]) -> str | None:
    """What a pool's block sizes (`block_size`, the policy's; `engines`, by backend) cost, in
    words, where they differ; None where they agree."""
    sizes = set(engines.values())
    if not sizes or sizes == {block_size}:
        return None
    said = ", ".join(f"{b} {s}" for b, s in sorted(engines.items()))
    if len(sizes) > 1:
        return (f"its engines' KV blocks differ ({said} tokens): each backend's predicted "
                f"cached tokens follow its own, and every reservation rounds to the largest "
                f"({max(sizes)}); give the pool engines of one block size")
    (engine,) = sizes
    if engine % block_size:
        return (f"its engines cache and allocate KV in blocks of {engine} tokens, which the "
                f"pool's block_size {block_size} does not divide: predicted cached tokens are "
                f"a lower bound; set block_size to {engine} (or a divisor of it)")
    return (f"its engines' KV blocks are {engine} tokens, the pool's block_size "
            f"{block_size}: prefix identity and reservations follow the engines' {engine}; "
            f"block_size {engine} would hash prompts {engine // block_size}x faster and plan "
            "capacity with the engines' block before their first scrape")
