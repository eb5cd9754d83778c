"""The simulated engine (`loadtest sim`): a vLLM-like scheduler over a roofline step-time model.

    SimConfig(...).resolve() -> EngineSpec      flags to concrete engine numbers (vLLM defaults)
    create_app(config) -> SimApp                the OpenAI-compatible ASGI app
    serve(config, host, port)                   uvicorn on loopback, with fault injection wired
    EngineCore(spec)                            the engine without HTTP, driven by any clock
    replay(spec, arrivals=..., closed_loop=...) a workload on a virtual clock (fidelity, what-ifs)

`server` (uvicorn, the tokenizer) is imported lazily so the engine core stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loadtest.sim.config import ConfigError, EngineSpec, SimConfig
from loadtest.sim.engine import EngineCore
from loadtest.sim.faults import FaultSettings
from loadtest.sim.replay import ReplayResult, WorkItem, replay

if TYPE_CHECKING:
    from loadtest.sim.server import SimApp, create_app, serve

__all__ = [
    "ConfigError",
    "EngineCore",
    "EngineSpec",
    "FaultSettings",
    "ReplayResult",
    "SimApp",
    "SimConfig",
    "WorkItem",
    "create_app",
    "replay",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name in ("SimApp", "create_app", "serve"):
        from loadtest.sim import server

        return getattr(server, name)
    raise AttributeError(name)
