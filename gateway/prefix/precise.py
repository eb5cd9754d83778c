"""Precise mode's subscriptions for a runtime: one per backend that publishes KV events.

Built from the policy in force: every backend with `kv_events` in a pool whose
`routing.prefix.mode` is `precise` gets a `Follower` on its prefix index and a `Subscriber` on
its engine's publisher, run as tasks of the runtime (a reload stops them and starts the new
policy's). A backend's `outstanding` requests tell the subscriber when silence is a stopped
stream rather than an idle engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from gateway.policy import Policy
from gateway.prefix.events import EventSource, EventState, Follower
from gateway.prefix.index import PrefixIndexes
from gateway.prefix.subscriber import Subscriber
from gateway.routing.backends import Backend

OnChange = Callable[[str, str], Callable[[Follower], None]]


class PreciseEvents:
    def __init__(self, policy: Policy, indexes: PrefixIndexes, backends: Iterable[Backend],
                 on_change: OnChange | None = None) -> None:
        by_name = {(b.pool, b.name): b for b in backends}
        self.followers: dict[tuple[str, str], Follower] = {}
        self.subscribers: list[Subscriber] = []
        for pool_name, pool in policy.pools.items():
            if pool.routing.prefix.mode != "precise":
                continue
            for spec in pool.backends:
                events = spec.kv_events
                backend = by_name.get((pool_name, spec.name))
                if events is None or backend is None:
                    continue
                follower = Follower(pool_name, spec.name, indexes, pool.block_size,
                                    on_change=on_change(pool_name, spec.name)
                                    if on_change is not None else None)
                self.followers[(pool_name, spec.name)] = follower
                self.subscribers.append(Subscriber(
                    EventSource(events.endpoint, events.replay_endpoint, events.topic),
                    follower, _busy(backend)))

    def start(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(s.run(), name=f"kv-events-{s.follower.pool}-"
                                                  f"{s.follower.backend}")
                for s in self.subscribers]

    def states(self) -> dict[tuple[str, str], EventState]:
        return {key: f.state for key, f in self.followers.items()}


def _busy(backend: Backend) -> Callable[[], bool]:
    return lambda: backend.outstanding > 0
