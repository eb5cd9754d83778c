"""The simulated engine as an OpenAI-compatible ASGI app, and `serve()` to run it on uvicorn.

One engine-loop task owns time: it asks the core for a batch, sleeps the step's simulated
duration x `time_scale`, then hands each request that got a token to its HTTP handler by setting
that handler's event. Handlers never touch the scheduler except to add or abort their request.

    create_app(SimConfig(...)) -> SimApp   a plain ASGI app (lifespan included), for in-process use
    await serve(config, host, port)        uvicorn on loopback, with the "down" fault wired in

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, and GET|POST|DELETE /admin/faults, GET /admin/state (see docs/simulator.md); the
Responses API, embeddings and tokenization are in endpoints.py and the modules it names, which
know `SimApp` only as host.py's `Host`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson
import uvicorn

from gateway.cost import RequestCostError
from gateway.tokens import (
    HFTokenizer,
    TokenCounter,
    Tokenizer,
    chat_chars,
    load_tokenizer,
    openai_messages,
)
from loadtest.sim import multimodal, prompts, sse
from loadtest.sim.config import SimConfig
from loadtest.sim.endpoints import Endpoints
from loadtest.sim.engine import EngineCore
from loadtest.sim.faults import (
    FaultError,
    FaultInjector,
    FaultSettings,
    RequestFaults,
    Wire,
    parse_update,
)
from loadtest.sim.host import EndpointOptions
from loadtest.sim.kv_events import KVEventPublisher, run_replay
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.outputs import OutputLengths
from loadtest.sim.protocol import (
    ApiError,
    ParsedRequest,
    bad_request,
    context_length_error,
    error_body,
    parse_chat,
    parse_completion,
    parse_json,
)
from loadtest.sim.scheduler import SYNTHETIC_VOCAB, SimRequest, Status
from loadtest.sim.steptime import FRONTEND_LATENCY_S

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("loadtest.sim")

JSON = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]


class _Sink:
    """Where the engine loop signals a handler that its request made progress."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def notify(self, _request: SimRequest) -> None:
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()
        self.event.clear()


class SimApp:
    """ASGI app of one simulated engine replica."""

    def __init__(self, config: SimConfig, tokenizer: Tokenizer | None = None,
                 options: EndpointOptions | None = None) -> None:
        self.config = config
        self.spec = config.resolve()
        self.options = options or EndpointOptions()
        self.options.check()
        self.core = EngineCore(self.spec)
        self.metrics = SimMetrics(self.spec)
        self.faults = FaultInjector(config.faults, config.seed)
        self.lengths = OutputLengths(config.seed)
        self.tokenizer = tokenizer
        self.counter: TokenCounter | None = None
        self.listener: Listener | None = None  # set by serve(); needed for the "down" fault
        self.kv_events: KVEventPublisher | None = None  # --kv-events-endpoint
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._salts = itertools.count(1)
        self.vocab_size = SYNTHETIC_VOCAB  # the model's and its tokenizer's, from startup()
        # Wall seconds the steps ran past their scaled simulated length: a simulation starved
        # of CPU runs slow and would pass its own limits off as the engine's.
        self.late_s = 0.0
        self._created = int(time.time())
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completion,
            ("GET", "/admin/faults"): self._faults_get,
            ("POST", "/admin/faults"): self._faults_post,
            ("DELETE", "/admin/faults"): self._faults_delete,
            ("GET", "/admin/state"): self._state,
        }
        self.endpoints = Endpoints(self)
        self._routes.update(self.endpoints.routes)

    # -- lifecycle ----------------------------------------------------------------------------
    async def startup(self) -> None:
        if self.tokenizer is None:
            # The Hugging Face encoder, as vLLM and SGLang count: the simulated engine stands
            # for them, and the gateway's rank encoder is checked against it.
            self.tokenizer = await asyncio.to_thread(
                load_tokenizer, self.config.tokenizer, chat_template=self.config.chat_template,
                encoder="huggingface")
        self.counter = TokenCounter(self.tokenizer)
        # Ids of unknown tokens (generated, or a prompt known by length) are drawn from the
        # model's vocabulary and the tokenizer's (without its special tokens), as an engine
        # samples ids its tokenizer decodes.
        words = self.tokenizer.vocab_size if isinstance(self.tokenizer, HFTokenizer) else None
        self.vocab_size = min(self.spec.model.vocab_size, words or self.spec.model.vocab_size)
        if self.config.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(self.config.kv_events_endpoint,
                                              self.config.kv_events_replay_endpoint,
                                              self.config.kv_events_topic)
            self.core.kv.pool.events = self.kv_events
            task = asyncio.create_task(run_replay(self.kv_events), name="sim-kv-replay")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self._loop_task = asyncio.create_task(self._engine_loop(), name="sim-engine-loop")
        log.info("simulated engine: %s", self.spec.describe())

    async def shutdown(self) -> None:
        self.endpoints.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for request in self.core.abort_all():
            if request.on_progress is not None:
                request.on_progress(request)
        if self.counter is not None:
            self.counter.close()
        if self.kv_events is not None:
            for task in list(self._background):
                task.cancel()
            self.kv_events.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = (self._routes.get((scope["method"], scope["path"]))
                       or self.endpoints.match(scope["method"], scope["path"]))
            if handler is None:
                status = 405 if any(p == scope["path"] for _, p in self._routes) else 404
                await _respond(send, status, orjson.dumps(
                    {"detail": "Method Not Allowed" if status == 405 else "Not Found"}))
                return
            await handler(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- the engine loop ----------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        scale = self.spec.time_scale
        while True:
            if not core.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = loop.time()
            step = core.begin_step(now)
            if step is None:  # everything left was aborted (or, defensively, cannot run yet)
                self.metrics.observe_state(core)
                await asyncio.sleep(0.001 if core.has_work else 0)
                continue
            # The deadline counts from the step's start, so the CPU time spent handing out
            # the previous step's tokens is part of this step, not added to it.
            delay = now + step.duration_s * scale - loop.time()
            if delay < 0:
                self.late_s -= delay
            await asyncio.sleep(delay if delay > 0 else 0)
            events = core.finish_step(step, loop.time())
            if self.kv_events is not None:
                self.kv_events.flush()  # one batch per step, as vLLM's engine core
            self.metrics.observe_step(core, events)
            for request in events.emitted:
                if request.on_progress is not None:
                    request.on_progress(request)

    # -- generation endpoints -----------------------------------------------------------------
    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(receive, send, parse_chat)

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(receive, send, parse_completion)

    async def _generate(self, receive: Receive, send: Send,
                        parse: Callable[[dict[str, Any]], ParsedRequest]) -> None:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        raw = await _read_body(receive)
        try:
            parsed = parse(parse_json(raw))
            if parsed.model is not None and parsed.model != self.spec.served_model_name:
                raise ApiError(404, f"The model `{parsed.model}` does not exist.", "model")
            faults = self.faults.draw()
            if faults.fail:
                raise ApiError(500, "Simulated engine failure (fault injection: fail_rate).")
            prompt_tokens, hashes, prompt_ids = await self.measure(parsed)
            error = context_length_error(self.spec.max_model_len, prompt_tokens,
                                         parsed.max_tokens)
            if error is not None:
                raise error
            chat = parsed.kind == "chat"
            request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            sink = _Sink()
            request = await self.enter(
                arrival, request_id, prompt_tokens, hashes,
                parsed.max_tokens or self.spec.max_model_len - prompt_tokens,
                parsed.min_tokens, parsed.ignore_eos, sink.notify, prompt_ids=prompt_ids)
        except ApiError as exc:
            await _respond(send, exc.status, exc.body())
            return
        watcher = asyncio.create_task(self._watch_disconnect(receive, request, sink))
        try:
            if parsed.stream:
                await self._stream(send, parsed, request, sink, faults)
            else:
                await self._respond_whole(send, chat, request, sink, faults)
        except OSError:
            pass  # the client went away mid-write
        finally:
            watcher.cancel()
            if not request.finished:
                self.core.abort(request)
                self._wake.set()

    async def enter(self, arrival: float, request_id: str, prompt_tokens: int,
                    hashes: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool,
                    on_progress: Callable[[SimRequest], None],
                    prompt_ids: Sequence[int] = ()) -> SimRequest:
        """A measured request into the engine's waiting queue (every generating endpoint): the
        API server's time, then the in-flight cap (ApiError 503), then the queue."""
        loop = asyncio.get_running_loop()
        # The API server's time (steptime.FRONTEND_LATENCY_S) before the request reaches the
        # engine's queue; this process's own parsing and tokenizing count towards it.
        frontend = arrival + FRONTEND_LATENCY_S * self.spec.time_scale - loop.time()
        if frontend > 0:
            await asyncio.sleep(frontend)
        limit = self.spec.max_num_queued_reqs
        if limit is not None and self.core.num_unfinished >= limit:
            raise ApiError(503, f"The server is overloaded: {self.core.num_unfinished} "
                           f"requests are in flight (--max-num-queued-reqs {limit}). "
                           "Please retry later.")
        target = self.lengths.draw(max_tokens, min(min_tokens, max_tokens), ignore_eos)
        request = SimRequest(request_id, prompt_tokens, max_tokens, target, arrival, hashes,
                             salt=next(self._salts), on_progress=on_progress,
                             prompt_ids=prompt_ids, vocab_size=self.vocab_size)
        # No await between the in-flight check above and this add: the count is exact.
        self.core.add(request)
        self._wake.set()
        return request

    def release(self, request: SimRequest) -> None:
        """Out of the engine if it is still in (the client left, or the caller is done)."""
        if not request.finished:
            self.core.abort(request)
            self._wake.set()

    async def measure(self, parsed: ParsedRequest) -> tuple[int, list[int], Sequence[int]]:
        """Exact prompt tokens (the gateway's tokenizer), block hashes for prefix caching, and
        the prompt's token ids where they are known (for the KV events' BlockStored)."""
        assert self.counter is not None, "SimApp.startup() was not run"
        block = self.spec.block_size
        caching = self.spec.enable_prefix_caching
        messages: list[dict[str, Any]] = []
        tokenizer = self.counter.tokenizer
        try:
            if caching and parsed.prefix_hash_ids is None and not parsed.images \
                    and isinstance(tokenizer, HFTokenizer) and parsed.prompt_ids is None:
                # An exact tokenizer gives the ids themselves: blocks hashed as the gateway
                # hashes them (gateway/prefix/hashing.py), so its prefix index and this cache
                # name the same blocks alike.
                ids: Sequence[int]
                if parsed.kind == "chat":
                    messages = openai_messages(parsed.messages)
                    self.counter.check_chars(chat_chars(messages, parsed.tools))
                    ids = await asyncio.to_thread(tokenizer.chat_ids, messages, parsed.tools,
                                                  **parsed.template_kwargs)
                else:
                    self.counter.check_chars(len(parsed.prompt_text or ""), "prompt")
                    ids = await asyncio.to_thread(tokenizer.text_ids, parsed.prompt_text or "")
                return len(ids), prompts.from_token_ids(ids, block), ids
            if parsed.kind == "chat":
                # vLLM's normalisation before the template (null content -> "", text parts
                # joined, tool-call arguments parsed), as the gateway counts.
                messages = openai_messages(parsed.messages)
                tokens = await self.counter.count_chat(messages, parsed.tools,
                                                       **parsed.template_kwargs)
                tokens += len(parsed.images) * self.options.image_tokens
            elif parsed.prompt_ids is not None:
                tokens = len(parsed.prompt_ids)
            else:
                tokens = await self.counter.count_text(parsed.prompt_text or "")
        except RequestCostError as exc:
            raise bad_request(str(exc), exc.param) from None
        if not caching:
            return tokens, [], ()
        if parsed.prefix_hash_ids is not None:
            hashes = prompts.from_hash_ids(parsed.prefix_hash_ids,
                                           self.spec.prefix_hash_block_size, tokens, block)
        elif parsed.prompt_ids is not None:
            hashes = prompts.from_token_ids(parsed.prompt_ids, block)
            return tokens, hashes, parsed.prompt_ids
        elif parsed.kind == "chat":
            hashes = prompts.from_messages(multimodal.keyed(messages, parsed.images),
                                           parsed.tools, tokens, block)
        else:
            hashes = prompts.from_text(parsed.prompt_text or "", tokens, block)
        return tokens, hashes, ()

    async def _watch_disconnect(self, receive: Receive, request: SimRequest, sink: _Sink) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not request.finished:
                    self.core.abort(request)
                    self._wake.set()
                sink.event.set()
                return

    async def _stream(self, send: Send, parsed: ParsedRequest, request: SimRequest,
                      sink: _Sink, faults: RequestFaults) -> None:
        frames = sse.Frames(parsed.kind == "chat", request.request_id,
                            self.spec.served_model_name, self._created)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        wire = Wire(send, faults)  # the frames as written: whole, or split or spaced by a fault
        # vLLM sends the assistant-role frame with the first token (its first engine output),
        # not at once: a client timing the first byte must see the prefill in it.
        role_pending = parsed.kind == "chat"
        drop_after = faults.drop_after
        stall_after = faults.stall_after
        sent = 0
        while True:
            await sink.wait()
            if request.status is Status.ABORTED:
                return  # client gone, or the engine "crashed": end without [DONE]
            produced = request.num_output_tokens
            done = request.status is Status.FINISHED
            out: list[bytes] = []
            if role_pending and produced > 0:
                out.append(frames.role())
                role_pending = False
            while sent < produced:
                if drop_after is not None and sent >= drop_after:
                    if out:
                        await wire.write(b"".join(out), True)
                    return  # returning mid-response makes uvicorn close the connection
                if stall_after is not None and sent == stall_after:
                    stall_after = None
                    if out:
                        await wire.write(b"".join(out), True)
                        out = []
                    await asyncio.sleep(faults.stall_s)
                    produced = request.num_output_tokens
                    done = request.status is Status.FINISHED
                if done and sent == produced - 1:
                    out.append(frames.last_token(sent, request.finish_reason or "length"))
                else:
                    out.append(frames.token(sent))
                sent += 1
            if done:
                if parsed.include_usage:
                    out.append(frames.usage(request.prompt_tokens, request.num_output_tokens,
                                            self.cached_tokens(request)))
                out.append(sse.DONE)
                await wire.write(b"".join(out), False)
                return
            if out:
                await wire.write(b"".join(out), True)

    async def _respond_whole(self, send: Send, chat: bool, request: SimRequest, sink: _Sink,
                             faults: RequestFaults) -> None:
        while not request.finished:
            await sink.wait()
        if request.status is Status.ABORTED:
            return
        if faults.stall_after is not None:
            await asyncio.sleep(faults.stall_s)
        build = sse.chat_response if chat else sse.completion_response
        body = build(request.request_id, self.spec.served_model_name, request.prompt_tokens,
                     request.num_output_tokens, request.finish_reason or "length",
                     self.cached_tokens(request))
        if faults.drop_after is not None:
            # Promise the whole body, send half of it, return: the client sees a cut response.
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*JSON, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body[:len(body) // 2],
                        "more_body": True})
            return
        await _respond(send, 200, body)

    def cached_tokens(self, request: SimRequest) -> int:
        """What vLLM reports as usage.prompt_tokens_details.cached_tokens: the prefix-cache hit
        at the request's first scheduling, with --enable-prompt-tokens-details."""
        if not self.options.enable_prompt_tokens_details:
            return 0
        return max(0, request.num_cached_tokens)

    # -- other endpoints ----------------------------------------------------------------------
    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b"", headers=[])

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = self.spec.served_model_name
        await _respond(send, 200, orjson.dumps({"object": "list", "data": [{
            "id": name, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": name, "parent": None, "max_model_len": self.spec.max_model_len,
            "permission": [],
        }]}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.observe_state(self.core)
        await _respond(send, 200, self.metrics.render(),
                       headers=[(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])

    async def _state(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self.core
        await _respond(send, 200, orjson.dumps({
            "running": core.num_running, "waiting": core.num_waiting,
            "kv_cache_usage": core.kv_usage, "num_gpu_blocks": self.spec.num_gpu_blocks,
            "free_blocks": core.kv.pool.num_free, "preemptions": core.scheduler.num_preemptions,
            "steps": core.steps, "simulated_busy_s": core.busy_s, "late_s": self.late_s,
            "prefix_cache_queried_tokens": core.kv.queried_tokens,
            "prefix_cache_hit_tokens": core.kv.hit_tokens,
            "max_model_len": self.spec.max_model_len, "max_num_seqs": self.spec.max_num_seqs,
            "max_num_batched_tokens": self.spec.max_num_batched_tokens,
            "time_scale": self.spec.time_scale,
        }))

    async def _faults_get(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps(self.faults.settings.to_json()))

    async def _faults_delete(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.faults.settings = FaultSettings()
        await _respond(send, 200, orjson.dumps(self.faults.settings.to_json()))

    async def _faults_post(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = orjson.loads(await _read_body(receive) or b"{}")
            settings, down = parse_update(self.faults.settings, body)
        except (orjson.JSONDecodeError, FaultError) as exc:
            await _respond(send, 400, error_body(400, str(exc)))
            return
        if down is not None and self.listener is None:
            await _respond(send, 400, error_body(
                400, "down_for_s: this app was not started by loadtest.sim.server.serve(), "
                "so it cannot close its listening socket"))
            return
        self.faults.settings = settings
        await _respond(send, 200, orjson.dumps(settings.to_json()))
        if down is not None and self.listener is not None:
            task = asyncio.create_task(
                self.listener.go_down(down.seconds, down.drop_inflight, self))
            self._background.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._background.discard)

    def crash(self) -> None:
        """What a crashed and restarted engine loses: every request and the prefix cache."""
        for request in self.core.abort_all():
            if request.on_progress is not None:
                request.on_progress(request)
        self.core.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        self.metrics.observe_state(self.core)


class Listener:
    """Closes and reopens uvicorn's listening socket for the "down" fault.

    Closing the listening socket makes new connections fail with ECONNREFUSED, exactly what a
    client sees when an engine process is gone; reopening binds the same address again.
    """

    def __init__(self, server: uvicorn.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.down_until: float | None = None

    async def go_down(self, seconds: float, drop_inflight: bool, app: SimApp) -> None:
        await asyncio.sleep(0.05)  # let the admin response leave first
        loop = asyncio.get_running_loop()
        self.down_until = loop.time() + seconds
        for server in self.server.servers:
            server.close()
        if drop_inflight:
            app.crash()
            for connection in list(self.server.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
        log.warning("fault injection: down for %.1f s (drop in-flight: %s)", seconds,
                    drop_inflight)
        await asyncio.sleep(seconds)
        await self._listen_again()
        self.down_until = None
        log.warning("fault injection: listening again on %s:%d", self.host, self.port)

    async def _listen_again(self) -> None:
        config = self.server.config
        server = self.server

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            # The same factory uvicorn's Server.startup builds.
            factory: Callable[..., asyncio.Protocol] = config.http_protocol_class
            return factory(config=config, server_state=server.server_state,
                           app_state=server.lifespan.state, _loop=_loop)

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(config.backlog)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        new = await loop.create_server(create_protocol, sock=sock, backlog=config.backlog)
        server.servers = [new]


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": JSON if headers is None else headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(config: SimConfig, tokenizer: Tokenizer | None = None,
               options: EndpointOptions | None = None) -> SimApp:
    """An ASGI app for `config`; raises `ConfigError` at once for a bad configuration."""
    return SimApp(config, tokenizer, options)


async def serve(config: SimConfig, host: str = "127.0.0.1", port: int = 8001,
                log_level: str = "info", access_log: bool = False,
                options: EndpointOptions | None = None) -> None:
    """Run the engine on uvicorn until SIGINT/SIGTERM (or the task is cancelled)."""
    app = create_app(config, options=options)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               access_log=access_log, lifespan="on",
                               timeout_graceful_shutdown=3)
    server = uvicorn.Server(uv_config)
    app.listener = Listener(server, host, port)
    await server.serve()

