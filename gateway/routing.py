"""Request -> pool -> backend. Plain code; knows nothing of HTTP.

A model may be served by several pools; the first pool in the policy that serves it and has a
healthy backend takes the request. (Token-range routing to a long-context pool builds on this.)
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.backends import Backend, Backends
from gateway.policy import ModelSpec, Policy
from gateway.protocol import ModelNotFound, NoBackendAvailable


@dataclass(frozen=True, slots=True)
class Route:
    model: ModelSpec
    pool: str


class Router:
    def __init__(self, policy: Policy, backends: Backends) -> None:
        self.policy = policy
        self.backends = backends
        self._models = {m.name: m for m in policy.models}
        self._pools_for = {m.name: policy.pools_for(m.name) for m in policy.models}

    def model(self, name: str) -> ModelSpec:
        spec = self._models.get(name)
        if spec is None:
            raise ModelNotFound(
                f"The model `{name}` does not exist. Models served here: "
                f"{', '.join(self._models)}.", param="model")
        return spec

    def route(self, model_name: str) -> Route:
        model = self.model(model_name)
        pools = self._pools_for[model.name]
        for pool in pools:
            if self.backends.healthy(pool):
                return Route(model, pool)
        if not pools:
            raise NoBackendAvailable(f"No pool serves the model `{model.name}`.")
        down = "; ".join(f"{b.pool}/{b.name}: {b.status(self.backends.clock())}"
                         for pool in pools for b in self.backends.pools[pool])
        raise NoBackendAvailable(
            f"No healthy backend for the model `{model.name}` ({down}).",
            headers={"retry-after": str(int(self.policy.health.probe_interval_s) or 1)})

    def pick(self, pool: str, exclude: tuple[Backend, ...] = ()) -> Backend | None:
        return self.backends.pick(pool, exclude)
