"""One request, top to bottom: the gateway's stages in the order they run, as plain code.

    identify   key -> tenant, priority, the caller's queue deadline       gateway/auth.py
    read       the body, bounded in size and time                           the transport's Client
    parse      JSON shape limits, then the fields the gateway needs         gateway/protocol.py
    count      prompt tokens, with the model's tokenizer and chat template  gateway/cost/
    route      model + prompt length -> pool                                gateway/routing.py
    estimate   KV blocks and token work                                     gateway/cost/work.py
    quota      the tenant's token buckets                                   gateway/quotas.py
    admit      admit now, queue, or refuse                                  gateway/admission/
    forward    to the engine, the answer streamed back as it comes          gateway/upstream/
    observe    metrics, access log, accounting, the latency guard           gateway/observe/
    release    the reservation and the quota, whatever ended the request

`serve` runs them all for `/v1/chat/completions` and `/v1/completions`; `preview` runs them up
to the admission decision for `/gateway/estimate`, through the very same stage functions, and
asks admission what it would decide without reserving. Nothing here speaks ASGI: the transport
hands in a `Client` (read the body, send an error, whether the caller has gone; with `Inbound`,
in gateway/inbound.py) and the forwarder writes the engine's answer through the client's
`send`. Refusals are the domain errors of gateway/errors.py; the client turns them into HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from gateway.admission.pool import Ticket
from gateway.admission.prefixes import hash_block_size
from gateway.affinity import Held
from gateway.cost import CostModel, PromptTooLong, RequestCostError
from gateway.eager import finish
from gateway.errors import GatewayError, InternalError, InvalidRequest, ServerBusy, UpstreamError
from gateway.inbound import Client, Headers, Inbound
from gateway.observe.accesslog import log_record, log_rejection
from gateway.observe.record import Record, charge_of, usage_of
from gateway.policy import ModelSpec
from gateway.prepared import Caller, Prepared, Sent, Work, is_embedding, profile_of
from gateway.prompts import Prompt, count_prompt
from gateway.protocol import (
    Endpoint,
    ParsedRequest,
    ResponsesRequest,
    answer_headers,
    client_deadline,
    endpoint_of,
    parse_request,
)
from gateway.quotas import QuotaTicket
from gateway.routing import Route
from gateway.runtime import Runtime
from gateway.upstream.forward import STAGE_CLOCK, ClientGone, Relay, Upstream

log = logging.getLogger("gateway.api")

# The stages timed into gateway_request_stage_seconds, in the order a request meets them;
# `queue` is the admission queue's wait, `admission` the decision and reservation without it.
STAGES = ("read", "parse", "count", "route", "quota", "queue", "admission", "upstream_headers")

# --- the pipeline -------------------------------------------------------------------------------

class Gate:
    """The requests this process is serving, and how many it may (`server.
    max_concurrent_requests`): past that one is answered 503 at once rather than queued
    without bound. Counted in `serve` itself, not by a coroutine around it: one fewer held by
    every open stream (gateway/serving/heap.py)."""

    __slots__ = ("cap", "open")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open = 0


class Pipeline:
    """The stages over one runtime (the policy in force and what it built)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.loop_time = asyncio.get_running_loop().time
        # Stage timers bound once: a request observes each with no label lookup, into plain
        # counts the metrics add up in batches (gateway/observe/batched.py).
        self._timed = rt.policy.server.stage_metrics
        self._stage = {name: rt.metrics.stage_observer(name) for name in STAGES}
        # Bound once: a stream's frame holds this for its whole life, and the sweep walks
        # whatever each stream holds (gateway/serving/heap.py).
        self._lap_timed: Callable[[str, float], float] = self._lap if self._timed else _no_lap
        # Each model's cost on each pool it is routed to, worked out on first use.
        self._costs: dict[tuple[str, str], CostModel] = {}
        # The block size each model's prompts are hashed at for prefix routing (None: not).
        pools = rt.policy.pools
        self._hash_block = {m.name: hash_block_size([pools[p] for p in rt.policy.pools_for(m.name)])
                            for m in rt.policy.models}

    # identify ---------------------------------------------------------------------------------

    def identify(self, headers: Headers) -> Caller:
        tenants = self.rt.tenants
        tenant = tenants.identify(headers.get(b"authorization"))
        return Caller(tenant, tenants.priority(tenant, headers.get(b"x-priority")),
                      client_deadline(headers))

    # read and parse ---------------------------------------------------------------------------

    async def read(self, client: Client) -> bytes:
        server = self.rt.policy.server
        return await client.read_body(server.max_body_bytes, server.body_timeout_s)

    def parse(self, body: bytes, endpoint: Endpoint | None
              ) -> tuple[Endpoint, dict[str, Any], ParsedRequest]:
        server = self.rt.policy.server
        if endpoint is None:
            endpoint = endpoint_of(body)
        data, parsed = parse_request(body, endpoint, server.max_json_depth,
                                     server.max_json_items)
        return endpoint, data, parsed

    # count ------------------------------------------------------------------------------------

    async def count(self, model: ModelSpec, data: dict[str, Any], parsed: ParsedRequest,
                    caller: Caller, prior_tokens: int = 0) -> Prompt:
        try:
            # Long prompts take turns by tenant (gateway/cost/counter.py).
            return await count_prompt(self.rt.counters[model.name], model, data, parsed,
                                      caller.tenant.name, prior_tokens,
                                      self._hash_block[model.name])
        except RequestCostError as exc:
            raise InvalidRequest(str(exc), param=exc.param,
                                 code="prompt_too_long" if isinstance(exc, PromptTooLong)
                                 else "invalid_value") from None

    # route ------------------------------------------------------------------------------------

    def route(self, model: ModelSpec, prompt: Prompt, parsed: ParsedRequest) -> Route:
        return self.rt.router.route(model, prompt.tokens, parsed.output_limit)

    # estimate ---------------------------------------------------------------------------------

    def estimate(self, model: ModelSpec, route: Route, prompt: Prompt,
                 parsed: ParsedRequest) -> Work:
        costs = self._costs.get((model.name, route.pool))
        if costs is None:
            costs = self._costs[model.name, route.pool] = self._cost_model(model, route.pool)
        try:
            cost = costs.cost(prompt.tokens, parsed.output_limit,
                              allow_prefill_only=is_embedding(parsed))
        except RequestCostError as exc:
            raise InvalidRequest(str(exc), param=exc.param) from None
        return Work(cost, prompt.prompts * (parsed.n or 1))

    def _cost_model(self, model: ModelSpec, pool_name: str) -> CostModel:
        rt = self.rt
        pool = rt.policy.pools[pool_name]
        return CostModel(profile_of(model), block_size=pool.block_size, tp=pool.tp,
                         default_max_tokens=pool.max_tokens_default
                         or rt.policy.defaults.max_tokens,
                         expected_output=rt.output_lengths[model.name],
                         kv_dtype=model.kv_cache_dtype, max_model_len=pool.max_model_len)

    # identify -> read -> parse -> count -> route -> estimate ----------------------------------

    async def prepare(self, inbound: Inbound, client: Client,
                      watch: bool = False, timed: bool = False) -> Prepared:
        """The stages before any state changes; the same for serving and for previewing.
        `timed`: each stage's time into gateway_request_stage_seconds (served requests)."""
        lap = self._lap_timed if timed else _no_lap
        caller = self.identify(inbound.headers)
        body = await self.read(client)
        read_at = self.loop_time()
        if watch:  # a flag, not a callback: nothing held for the stream's life
            client.watch()
        t = lap("read", inbound.started)
        endpoint, data, parsed = self.parse(body, inbound.endpoint)
        model = self.rt.router.model(parsed.model)
        self.rt.tenants.check_model(caller.tenant, model.name)
        t = lap("parse", t)
        held = await self._held(parsed)
        prompt = await self.count(model, data, parsed, caller, held.tokens if held else 0)
        t = lap("count", t)
        route = self.route(model, prompt, parsed)
        if held is not None and held.pool != route.pool and held.pool in self.rt.policy.pools:
            route = Route(model, held.pool)  # the conversation lives there
        work = self.estimate(model, route, prompt, parsed)
        lap("route", t)
        user = data.get("user")
        session = inbound.headers.get(b"x-session-id")  # else the body's `user`
        return Prepared(caller, endpoint, model, data, parsed, prompt, route, work, held,
                        read_at, session.decode("latin-1") if session
                        else user if isinstance(user, str) and user else None)

    def _lap(self, stage: str, since: float) -> float:
        now = STAGE_CLOCK()
        self._stage[stage](now - since)
        return now

    async def _held(self, parsed: ParsedRequest) -> Held | None:
        if isinstance(parsed, ResponsesRequest) and parsed.previous_response_id:
            return await self.rt.affinity.recall(parsed.previous_response_id)
        return None

    # preview: /gateway/estimate ---------------------------------------------------------------

    async def preview(self, inbound: Inbound, client: Client) -> dict[str, Any]:
        """What `serve` would do with this request now, up to the admission decision."""
        p = await self.prepare(inbound, client)
        return {
            "model": p.model.name,
            "endpoint": p.endpoint,
            "tenant": p.caller.tenant.name,
            "priority": p.caller.priority,
            "deadline_s": p.caller.deadline_s,
            "pool": p.route.pool,
            "overflow": p.route.overflow,
            "prompt_tokens": p.prompt.tokens,
            "prompt_blocks_hashed": len(p.prompt.hashes),
            "exact": p.prompt.exact,
            "sequences": p.work.sequences,
            "reserve_blocks": p.work.blocks,
            "reserve_tokens": p.work.tokens,
            "cost": p.work.cost.to_dict(),
            "decision": self.rt.admission.preview(p.ask(self.loop_time())),
        }

    # serve: quota -> admit -> forward -> observe -> release -----------------------------------

    async def serve(self, inbound: Inbound, client: Client,
                    watch: bool = False, gate: Gate | None = None) -> None:
        """The whole request. Whatever ends it (an answer, a refusal, the caller leaving, an
        engine failing, a bug), its reservation and quota are released and it is observed;
        the caller gets an answer in OpenAI's error shape for anything but a full answer.
        `gate`: counted in it while served, and refused if it is full."""
        rt = self.rt
        record: Record | None = None
        ticket: Ticket | None = None
        quota: QuotaTicket | None = None
        forward_start = 0.0
        refused = False  # answered with an error (and counted) before a record was made
        task = asyncio.current_task()
        if gate is not None:
            gate.open += 1  # then at once into the `try` whose `finally` uncounts it
        try:
            if gate is not None and gate.open > gate.cap:
                raise ServerBusy("The gateway is handling as many requests as it is "
                                 "configured to; retry shortly.", retry_after_s=1.0)
            p = await self.prepare(inbound, client, watch, timed=True)
            lap = self._lap_timed
            t = STAGE_CLOCK()
            quota = await rt.quotas.take(p.caller.tenant, p.work.quota_tokens, p.route.pool)
            t = lap("quota", t)
            upstream_body, strip_usage = self._upstream_body(p)
            ticket = await rt.admission.admit(p.ask(self.loop_time()))
            if self._timed:
                self._stage["queue"](ticket.queue_s)
                lap("admission", t + ticket.queue_s)
            relay = Relay()
            record = Record(inbound.request_id, p.endpoint, p.model.name, p.route.pool,
                            p.caller.tenant.name, bool(p.parsed.stream), inbound.arrival,
                            p.prompt.tokens, relay)
            headers = answer_headers(inbound.request_id, p.route.pool, ticket.decision,
                                     ticket.queue_s, p.prompt.tokens, ticket.cached_tokens,
                                     quota.window if quota is not None else None)
            up = Upstream(inbound.request_id, p.endpoint, p.route.pool, upstream_body,
                          bool(p.parsed.stream), headers,
                          strip_usage, rt.admission.on_first_byte, ticket)
            del upstream_body, headers  # `up` holds them: the body until sent, the headers too
            forward_start = asyncio.get_running_loop().time()
            forward_at = STAGE_CLOCK()
            if not up.stream:
                # The engine's usage comes only with a whole answer: read it even if the
                # caller leaves (bounded), or the caller could cut to dodge its quota.
                client.linger(rt.policy.upstream.disconnect_drain_s)
            else:
                rt.admission.watch(ticket, relay, forward_start,
                                   p.work.cost.expected_output_tokens)
            sent = Sent.of(p)
            # The stream keeps `sent`, not the request: a full collection walks what an open
            # stream holds, for as long as it is open (tests/test_stream_holds.py).
            del p
            # Forwarded from here, not from a coroutine of its own: one fewer held by every
            # open stream for the collector's sweep to walk (gateway/serving/heap.py).
            inflight = rt.metrics.pool_children(up.pool)[3]
            inflight.inc()
            try:
                await rt.forwarder.forward(up, relay, client.send, ticket.backend)
            finally:
                inflight.dec()
                await self._forwarded(sent, up, relay, ticket)
            if self._timed and relay.headers_at is not None:
                self._stage["upstream_headers"](relay.headers_at - forward_at)
        except asyncio.CancelledError:
            if not client.gone:
                raise
            if task is not None:
                task.uncancel()  # the caller left: handled here, not an error of ours
        except ClientGone:
            pass
        except GatewayError as err:
            refused = True
            await self._refused(inbound, client, record, err)
        except Exception:
            refused = True
            log.exception("unexpected error in request %s", inbound.request_id)
            await self._refused(inbound, client, record, InternalError(
                f"Internal gateway error (request id {inbound.request_id})."))
        finally:
            if gate is not None:
                gate.open -= 1
            client.detach()
            # Finished whatever cancels the request: a second cancellation must not leak a
            # reservation or a quota (gateway/eager.py).
            if ticket is not None:
                await finish(rt.admission.release(ticket))
            if quota is not None:
                await finish(rt.quotas.settle(quota, charge_of(record, quota.taken,
                                                               client.gone)))
        if record is not None:
            self.observe(record, client.gone, forward_start)
        elif client.gone and not refused:  # left before it went upstream: counted all the same
            rt.metrics.request_done("", "", 499)
            log_rejection(inbound.request_id, inbound.endpoint or "", 499,
                          "The caller closed the connection before its request was sent on.")

    def _upstream_body(self, p: Prepared) -> tuple[bytes, bool]:
        """The body the engine gets: the pool's model name, and a usage frame asked for."""
        data, parsed = p.data, p.parsed
        strip_usage = False
        if p.endpoint in ("chat", "completions") and parsed.stream \
                and not parsed.include_usage:
            # Ask the engine for its usage frame so tokens are counted as the engine counts
            # them; the caller, who did not ask, never sees it.
            data["stream_options"] = {**(data.get("stream_options") or {}),
                                      "include_usage": True}
            strip_usage = True
        # Always what the gateway read, never the caller's bytes: JSON with a key twice reads
        # last-wins here and first-wins in some engines, and the engine must run what was
        # counted and admitted.
        data["model"] = p.model.upstream_name
        return orjson.dumps(data), strip_usage

    async def _forwarded(self, sent: Sent, up: Upstream, relay: Relay, ticket: Ticket) -> None:
        """What the engine's answer teaches, whatever ended it: the stored response's place,
        output lengths, the prefix index, the cost accountant."""
        rt = self.rt
        if relay.response_id is not None and relay.backend is not None and sent.store:
            # Where it is stored, and what its conversation now costs the next turn.
            tokens = (relay.prompt_tokens or sent.prompt_tokens) + (relay.completion_tokens or 0)
            await rt.affinity.remember(relay.response_id,
                                       Held(up.pool, relay.backend.name, tokens))
        self._learn(sent, relay)
        rt.admission.prefix.observed(ticket, relay.prompt_tokens, relay.cached_tokens)
        used = usage_of(sent.endpoint, up.stream, sent.prompt_tokens, relay)
        if used is not None:
            rt.accountant.record(up.pool, sent.tenant, *used, profile_of(sent.model),
                                 rt.backends.pools_inflight(up.pool))

    async def _refused(self, inbound: Inbound, client: Client, record: Record | None,
                       err: GatewayError) -> None:
        if record is not None and record.relay.backend is not None \
                and isinstance(err, UpstreamError) and err.backend is None:
            err.backend = record.relay.backend.name
        status = await client.reply_error(
            err, record is not None and record.relay.response_started)
        if record is not None:
            record.status = status
            record.error = err.message
        else:
            self.rt.metrics.request_done("", "", status)
            log_rejection(inbound.request_id, inbound.endpoint or "", status, err.message)

    # observe ----------------------------------------------------------------------------------

    def _learn(self, sent: Sent, relay: Relay) -> None:
        """Feed completed requests back: output lengths, and the char ratio of `none`
        tokenizers."""
        if relay.status != 200:
            return
        rt = self.rt
        if relay.completion_tokens is not None:
            rt.output_lengths[sent.model.name].observe(relay.completion_tokens)
        if not sent.exact and relay.prompt_tokens and sent.chars:
            error = rt.counters[sent.model.name].tokenizer.observe(sent.chars,
                                                                   relay.prompt_tokens)
            rt.metrics.child(rt.metrics.token_estimate_error, sent.model.name).observe(
                abs(error))

    def observe(self, record: Record, gone: bool, forward_start: float) -> None:
        rt = self.rt
        relay = record.relay
        now = asyncio.get_running_loop().time()
        if not record.status:
            record.status = relay.status
        if gone:
            record.status = 499  # nginx's "client closed request"
        if relay.finished is None:
            relay.finished = now
        duration, ttft, tpot, _ = rt.metrics.pool_children(record.pool)
        rt.metrics.request_done(record.pool, record.model, record.status)
        duration.observe(relay.finished - record.arrival)
        if record.status == 200 and relay.first_byte is not None:
            ttft.observe(relay.first_byte - record.arrival)
            tokens = relay.completion_tokens
            if tokens is None and record.stream:
                tokens = max(0, relay.sse_events - 2)  # minus the role frame and [DONE]
            tpot_s = None
            if record.stream and tokens and tokens > 1:
                tpot_s = (relay.finished - relay.first_byte) / (tokens - 1)
                tpot.observe(tpot_s)
            # The guard watches the engines' latency, without our own queueing in it:
            # otherwise queueing would read as slowness and shrink the limit that causes it.
            rt.admission.observe_latency(record.pool, relay.first_byte - forward_start, tpot_s,
                                         admitted_s_ago=now - forward_start)
        log_record(record, gone)


# --- helpers of the stages ----------------------------------------------------------------------

def _no_lap(stage: str, since: float) -> float:
    return since


__all__ = ["Caller", "Client", "Inbound", "Pipeline", "Prepared", "Prompt", "Record", "Work"]
