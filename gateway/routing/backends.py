"""Runtime state of each engine replica: outstanding work and health.

Health is passive and active together:
- passive: `failure_threshold` consecutive failures (connect errors, 5xx, broken streams) eject
  a backend for `cooldown_s`; one success resets the count;
- active: a prober GETs each backend's health path every `probe_interval_s` (the GET is the
  upstream seam's: gateway/upstream/aio.py `AioClient.probe`); a failed probe marks it down
  until a probe succeeds.
A backend takes traffic when its last probe succeeded and it is not ejected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from gateway.observe.metrics import GatewayMetrics
from gateway.policy import BackendSpec, Policy, PoolSpec

log = logging.getLogger("gateway.routing.backends")

Clock = Callable[[], float]
# One health probe: (url, the backend's authorization header, timeout in seconds) -> (up, what
# it saw, in words for the log).
Probe = Callable[[str, str | None, float], Awaitable[tuple[bool, str]]]
# Where an OpenAI-compatible engine (vLLM, SGLang) serves each endpoint the gateway forwards.
ENGINE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                "responses": "/v1/responses", "embeddings": "/v1/embeddings",
                "tokenize": "/tokenize", "detokenize": "/detokenize",
                "rerank": "/v1/rerank", "score": "/v1/score", "classify": "/classify",
                "pooling": "/pooling", "messages": "/v1/messages"}


@dataclass(eq=False)
class Backend:
    pool: str
    name: str
    url: str
    urls: dict[str, str]  # endpoint -> the engine's URL for it, built once
    probe_url: str
    auth_header: str | None
    outstanding: int = 0
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    probe_ok: bool = True
    last_error: str = ""
    _up_gauge: object = field(default=None, repr=False)

    def available(self, now: float) -> bool:
        return self.probe_ok and now >= self.ejected_until

    def public_status(self, now: float) -> str:
        """`status` without the failure's details (they may name the engine's address): what
        callers and /readyz see; the admin API shows the details."""
        if not self.probe_ok:
            return "down: health probe failed"
        if now < self.ejected_until:
            return (f"ejected for {self.ejected_until - now:.1f}s after "
                    f"{self.consecutive_failures} consecutive failures")
        return "up"

    def status(self, now: float) -> str:
        if not self.probe_ok:
            return f"down: health probe failed ({self.last_error})"
        if now < self.ejected_until:
            return (f"ejected for {self.ejected_until - now:.1f}s after "
                    f"{self.consecutive_failures} consecutive failures ({self.last_error})")
        return "up"


class Backends:
    """All backends of the policy, grouped by pool, with passive health bookkeeping."""

    def __init__(self, policy: Policy, metrics: GatewayMetrics,
                 clock: Clock = time.monotonic, upstream_key: str | None = None) -> None:
        self.policy = policy
        self.upstream_key = upstream_key
        self.metrics = metrics
        self.clock = clock
        # Told (pool, backend, why) when a backend goes out of service: ejected or down. Its
        # engine's prefix cache is gone or unknown from then (gateway/admission/prefixes.py).
        self.on_lost: Callable[[str, str, str], None] | None = None
        self.pools: dict[str, list[Backend]] = {
            name: [self._make(name, pool, spec, upstream_key) for spec in pool.backends]
            for name, pool in policy.pools.items()
        }
        for b in self.all():
            self._publish(b)

    @staticmethod
    def _make(pool_name: str, pool: PoolSpec, spec: BackendSpec,
              default_key: str | None) -> Backend:
        # The caller's key never goes upstream; the engine gets the policy's key, if any.
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else default_key
        return Backend(
            pool=pool_name, name=spec.name, url=spec.url,
            urls={endpoint: spec.url + path for endpoint, path in ENGINE_PATHS.items()},
            probe_url=spec.url + pool.probe_path,
            auth_header=f"Bearer {key}" if key else None,
        )

    def all(self) -> Iterable[Backend]:
        for backends in self.pools.values():
            yield from backends

    def pools_inflight(self, pool: str) -> int:
        return sum(b.outstanding for b in self.pools[pool])

    def healthy(self, pool: str) -> list[Backend]:
        now = self.clock()
        return [b for b in self.pools[pool] if b.available(now)]

    def record_success(self, b: Backend) -> None:
        if b.consecutive_failures:
            b.consecutive_failures = 0
            self._publish(b)

    def record_failure(self, b: Backend, kind: str, detail: str) -> None:
        self.metrics.upstream_errors.labels(b.pool, b.name, kind).inc()
        b.consecutive_failures += 1
        b.last_error = detail
        if b.consecutive_failures >= self.policy.health.failure_threshold:
            if b.ejected_until <= self.clock():
                log.warning("ejecting backend %s/%s for %.0fs: %s", b.pool, b.name,
                            self.policy.health.cooldown_s, detail)
                if self.on_lost is not None:
                    self.on_lost(b.pool, b.name, "ejected")
            b.ejected_until = self.clock() + self.policy.health.cooldown_s
        self._publish(b)

    def _publish(self, b: Backend) -> None:
        self.metrics.backend_up.labels(b.pool, b.name).set(1 if b.available(self.clock()) else 0)

    # --- active probing ---------------------------------------------------------------------

    async def probe_all(self, probe: Probe) -> None:
        await asyncio.gather(*(self._probe(probe, b) for b in self.all()))

    async def _probe(self, probe: Probe, b: Backend) -> None:
        # The probe carries the backend's key, as requests do: an engine that requires one
        # answers 401 to a bare probe and would look down forever.
        ok, detail = await probe(b.probe_url, b.auth_header, self.policy.health.probe_timeout_s)
        if ok != b.probe_ok:
            log.warning("backend %s/%s is %s (%s)", b.pool, b.name, "up" if ok else "down",
                        detail)
            if not ok and self.on_lost is not None:
                self.on_lost(b.pool, b.name, "down")
        b.probe_ok = ok
        if not ok:
            b.last_error = f"probe {detail}"
        # An ejected backend stays out for its cooldown even if /health answers: engines
        # often pass their health check while failing requests.
        self._publish(b)

    async def run_prober(self, probe: Probe) -> None:
        while True:
            await asyncio.sleep(self.policy.health.probe_interval_s)
            try:
                await self.probe_all(probe)
            except Exception:  # never let the prober die; the next round tries again
                log.exception("health probe round failed")
