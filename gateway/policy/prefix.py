"""The policy's prefix-routing keys: a pool's `routing.prefix` and a backend's `kv_events`
(issue 19; gateway/routing/router.py and gateway/prefix/ read them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

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


# The share-based score's weights (before the cost in tokens): a policy naming them is told what
# replaced them rather than only that the key is unknown.
_REPLACED = ("cache_weight", "kv_weight", "prefill_weight")


class PrefixRoutingSpec(Strict):
    """Prefix-cache-aware choice of backend within a pool (`prefix_order`,
    gateway/routing/router.py).

    Each backend is ranked by the tokens taking the request would cost it: its prefill backlog,
    the part of the prompt not cached there, and inflight_weight x its tokens in flight; no
    backend is preferred while it would hold more than (1 + imbalance_epsilon) x the mean
    in-flight tokens (and more than the mean + imbalance_slack_tokens) and another would not.
    """

    # off: most KV headroom first (as before). approximate: the index learnt from what this
    # gateway sent. precise: the engines' KV cache events where a backend has `kv_events`.
    # shadow: approximate evaluated and counted, placement as with off. session: affinity by
    # session only (consistent hashing), no prefix index.
    mode: Literal["off", "approximate", "precise", "shadow", "session"] = "approximate"
    # A token in flight at a backend counts as this many tokens of prefill there: the decoding
    # load a cache hit may add to one backend before the next turn goes elsewhere. 0.25 by the
    # offline replays in docs/benchmarks.md (hit rate, TTFT and balance on the Mooncake trace
    # and the multi-turn synthetic against 0.5 and 1).
    inflight_weight: NonNegativeFloat = 0.25
    # The hard bound beside the cost: past (1 + epsilon) x the mean in-flight tokens ...
    imbalance_epsilon: NonNegativeFloat = 1.0
    # ... and past the mean + this many tokens, a backend is tried only after the others: a
    # relative bound alone would split every conversation at low load (SGLang's
    # balance_abs_threshold); one long prompt must fit under it.
    imbalance_slack_tokens: Annotated[int, Field(ge=0)] = 32768
    # Where no backend holds any of the prompt: the backend the session's hash picks
    # (header x-session-id, else the request's `user` field), within the same bound.
    session_affinity: bool = True
    # The approximate index's capacity per backend, in blocks; unset: the backend's KV blocks.
    capacity_blocks: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _replaced(cls, data: object) -> object:
        gone = sorted(k for k in _REPLACED if isinstance(data, dict) and k in data)
        if gone:
            raise ValueError(
                f"{', '.join(gone)}: replaced by `inflight_weight` (backends are now ranked by "
                "the tokens taking the request would cost them: prefill backlog + the prompt "
                "not cached there + inflight_weight x tokens in flight; docs/policy.md)")
        return data

    @field_validator("mode", mode="before")
    @classmethod
    def _off(cls, value: object) -> object:
        # YAML 1.1 reads a bare `off` as false: take it as the word it was meant as.
        return "off" if value is False else value


class RoutingSpec(Strict):
    prefix: PrefixRoutingSpec = PrefixRoutingSpec()
