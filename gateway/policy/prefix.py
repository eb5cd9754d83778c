"""The policy's prefix-routing keys: a pool's `routing.prefix` and a backend's `kv_events`
(issue 19; gateway/routing.py and gateway/prefix/ read them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from gateway.policy.base import NonNegativeFloat, PositiveInt, Strict


class KvEventsSpec(Strict):
    """Where an engine publishes its KV cache events (vLLM `--kv-events-config`: a ZMQ PUB
    `endpoint`, a ROUTER `replay_endpoint` for missed sequence numbers, and a `topic`)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, value: str | None) -> str | None:
        if value is None:
            return value
        scheme, sep, rest = value.partition("://")
        if not sep or not rest or scheme not in ("tcp", "ipc"):
            raise ValueError(f"expected a ZMQ endpoint like tcp://host:port or ipc://path, "
                             f"got {value!r}")
        if scheme == "tcp":
            port = rest.rpartition(":")[2]
            if ":" not in rest or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"expected tcp://host:port with a port, got {value!r}")
        return value


class PrefixRoutingSpec(Strict):
    """Prefix-cache-aware choice of backend within a pool (gateway/routing.py `prefix_order`).

    Each backend is scored by the share of the prompt it would serve from its prefix cache
    against its load; no backend is preferred while it holds more than (1 + imbalance_epsilon)
    x the mean in-flight tokens and another holds less.
    """

    # off: most KV headroom first (as before). approximate: the index learnt from what this
    # gateway sent. precise: the engines' KV cache events where a backend has `kv_events`.
    # shadow: approximate evaluated and counted, placement as with off. session: affinity by
    # session only (consistent hashing), no prefix index.
    mode: Literal["off", "approximate", "precise", "shadow", "session"] = "approximate"
    cache_weight: NonNegativeFloat = 1.0  # x the share of the prompt cached there
    # The load terms are small: they choose among backends that hold alike; balance is the
    # bound's job (cache match while balanced, load past the bound: SGLang's cache-aware rule).
    kv_weight: NonNegativeFloat = 0.1  # x the share of its KV limit reserved
    prefill_weight: NonNegativeFloat = 0.1  # x its prefill backlog, as a share of the pool's
    imbalance_epsilon: NonNegativeFloat = 0.1
    # ... or by more than this many tokens over the mean, whichever is more: at low load a
    # relative bound alone would split every conversation (SGLang's balance_abs_threshold).
    imbalance_slack_tokens: Annotated[int, Field(ge=0)] = 8192
    # Where no backend holds any of the prompt: the backend the session's hash picks
    # (header x-session-id, else the request's `user` field), within the same bound.
    session_affinity: bool = True
    # The approximate index's capacity per backend, in blocks; unset: the backend's KV blocks.
    capacity_blocks: PositiveInt | None = None

    @field_validator("mode", mode="before")
    @classmethod
    def _off(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` as false: take it as the word it was meant as.
        return "off" if value is False else value


class RoutingSpec(Strict):
    prefix: PrefixRoutingSpec = PrefixRoutingSpec()
