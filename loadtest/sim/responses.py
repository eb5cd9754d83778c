"""The Responses API, as vLLM's OpenAI server serves it (vllm/entrypoints/openai/responses/:
serving.py, protocol.py, utils.py, api_router.py, streaming_events.py).

    POST /v1/responses                   create (stream, background, store, previous_response_id)
    GET  /v1/responses/{id}              a stored response; ?stream=true&starting_after=N replays
                                         and follows a background stream's events
    POST /v1/responses/{id}/cancel       cancel a background response still queued

The request becomes chat messages as vLLM's `construct_input_messages` builds them
(`instructions` as a system message first, then a previous response's conversation without its
system messages and its output as assistant messages, then the input items: messages as they
are, `function_call` items as assistant tool calls, `function_call_output` items as tool
messages), rendered with the chat template with the generation prompt and counted; function
tools are rendered as chat tools. It then runs through the same engine as a chat request
(frontend time, `--max-num-queued-reqs`, the scheduler), and its output is the filler text,
one word per token.

Stored responses behave as vLLM's with `VLLM_ENABLE_RESPONSES_API_STORE=1` (vLLM's default is
to ignore `store`), but bounded: the most recent `responses_store_max`, each for
`responses_store_ttl_s` after its last update, at most `responses_store_max_bytes` of
conversation in all. A background response is stored at once with status "queued" and replaced
by the finished response; cancelling it aborts it in the engine. A response not in the
background is stored when it is finished, so it cannot be cancelled ("Cannot cancel a
synchronous response.", as vLLM answers for anything not queued or in progress).

Streams are vLLM's typed SSE events (`event: <type>` / `data: {...}` with `type` and
`sequence_number`, no `[DONE]`): response.created, response.in_progress, then with the first
token response.output_item.added and response.content_part.added, one
response.output_text.delta per token, then response.output_text.done,
response.content_part.done, response.output_item.done and response.completed, which carries the
whole response with its usage. Every event is a function of the response and its token count, so
a background stream is replayed by regenerating its events, not by keeping them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.cost import RequestCostError
from gateway.tokens import openai_messages
from loadtest.sim import prompts, sse
from loadtest.sim.asgi import (
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    query,
    read_body,
    respond,
    respond_cut,
    watch_disconnect,
)
from loadtest.sim.faults import RequestFaults
from loadtest.sim.host import Host
from loadtest.sim.multimodal import ImageError, keyed, split_images
from loadtest.sim.protocol import (
    ApiError,
    ResponsesParsed,
    bad_request,
    check_model,
    parse_json,
    parse_responses,
)
from loadtest.sim.scheduler import SimRequest, Status

RESPONSES_PREFIX = "/v1/responses/"
INVALID = "invalid_request_error"  # the error `type` vLLM's Responses API gives its own checks
CANCELLABLE = ("queued", "in_progress")


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_id", INVALID)


# -- the request as chat messages (vllm/entrypoints/openai/responses/utils.py) -----------------

def input_messages(parsed: ResponsesParsed, prev: Entry | None) -> list[dict[str, Any]]:
    """`construct_input_messages`: instructions, the previous conversation, the new input."""
    messages: list[dict[str, Any]] = []
    if parsed.instructions:
        messages.append({"role": "system", "content": parsed.instructions})
    if prev is not None:
        # Instructions do not carry over from one response to the next.
        messages.extend(m for m in prev.messages if m.get("role") != "system")
        for item in prev.response.get("output") or []:
            if item.get("type") == "message":  # reasoning items are skipped, as vLLM does
                for part in item.get("content") or []:
                    messages.append({"role": "assistant", "content": part.get("text", "")})
    if isinstance(parsed.input, str):
        messages.append({"role": "user", "content": parsed.input})
    else:
        messages.extend(items_to_messages(parsed.input))
    return messages


def _first_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        first = content[0]
        return str(first.get("text", "")) if isinstance(first, Mapping) else str(first)
    return ""


def items_to_messages(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`construct_chat_messages_with_tool_call`: input items to chat messages. A tool call or
    reasoning item joins the assistant message just before it, when there is one."""
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        kind = item.get("type")
        role = item.get("role")
        last = out[-1] if out and out[-1].get("role") == "assistant" else None
        if kind == "function_call":
            fields = {name: item.get(name) for name in ("call_id", "name", "arguments")}
            for name, value in fields.items():
                if not isinstance(value, str):
                    raise bad_request(f"input[{index}]: a function_call item needs `{name}` "
                                      "(a string)", "input")
            call = {"id": fields["call_id"], "type": "function",
                    "function": {"name": fields["name"], "arguments": fields["arguments"]}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": item.get("output"),
                        "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            content, summary = item.get("content"), item.get("summary")
            text = _first_text(content) if content else _first_text(summary)
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = text
            else:
                out.append({"role": "assistant", "reasoning": text})
        elif kind in (None, "message") and role == "assistant":
            text = _first_text(item.get("content"))
            if last is not None and last.get("content") is None:
                last["content"] = text
            else:
                out.append({"role": "assistant", "content": text})
        elif kind in (None, "message") and isinstance(role, str):
            message = {"role": role, "content": item.get("content")}
            if isinstance(item.get("name"), str):
                message["name"] = item["name"]
            out.append(message)
        else:
            raise bad_request(f"input[{index}]: input items of type {kind!r} are not supported "
                              "by the simulator", "input")
    return out


def continues_final_message(value: str | list[dict[str, Any]]) -> bool:
    """`should_continue_final_message`: the input ends in a partial assistant message."""
    if isinstance(value, str) or not value:
        return False
    last = value[-1]
    return (last.get("type", "message") in ("message", "reasoning")
            and last.get("status") in ("in_progress", "incomplete"))


def function_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """`construct_tool_dicts`: the function tools, in chat-completions form, for the template."""
    if not tools:
        return None
    return [{"type": "function",
             "function": {"name": t["name"], "description": t.get("description"),
                          "parameters": t.get("parameters")}}
            for t in tools if t.get("type") == "function"]


# -- the Response object (ResponsesResponse.from_request) ---------------------------------------

def response_object(parsed: ResponsesParsed, response_id: str, created: int, model: str,
                    max_tokens: int) -> dict[str, Any]:
    """The response as created: in progress, no output, no usage."""
    echo = parsed.echo
    return {
        "id": response_id, "created_at": created, "incomplete_details": None,
        "instructions": parsed.instructions, "metadata": echo["metadata"], "model": model,
        "object": "response", "output": [],
        "parallel_tool_calls": echo["parallel_tool_calls"],
        "temperature": 1.0 if echo["temperature"] is None else echo["temperature"],
        "tool_choice": echo["tool_choice"], "tools": parsed.tools,
        "top_p": 1.0 if echo["top_p"] is None else echo["top_p"],
        "background": parsed.background, "max_output_tokens": max_tokens,
        "max_tool_calls": echo["max_tool_calls"],
        "previous_response_id": parsed.previous_response_id, "prompt": None,
        "reasoning": parsed.reasoning, "service_tier": echo["service_tier"],
        "status": "in_progress", "text": echo["text"], "top_logprobs": echo["top_logprobs"],
        "truncation": parsed.truncation, "usage": None, "user": echo["user"],
        "input_messages": None, "output_messages": None,
    }


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "content": [_text_part(text, None)] if text else [],
            "role": "assistant", "status": status, "type": "message"}


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "input_tokens_per_turn": [],
                                 "cached_tokens_per_turn": []},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": prompt_tokens + output_tokens,
    }


def finished_response(base: Mapping[str, Any], item_id: str,
                      request: SimRequest) -> dict[str, Any]:
    """vLLM's status: "incomplete" (max_output_tokens) when it stopped at the limit."""
    n = request.num_output_tokens
    incomplete = request.finish_reason == "length"
    return {**base, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": [message_item(item_id, sse.filler_text(n))],
            "usage": usage(request.prompt_tokens, max(request.num_cached_tokens, 0), n)}


# -- one response in the engine, and its events -------------------------------------------------

def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({**fields, "sequence_number": seq, "type": kind}) + b"\n\n")


_DELTA_HEAD = (b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"')
_DELTA_TAIL = b',"type":"response.output_text.delta"}\n\n'
FIRST_DELTA = 4  # sequence number of the first token's delta


class Run:
    """A response in the engine: its request, its events, whoever waits on it."""

    __slots__ = ("_delta_mid", "base", "cancelled", "changed", "final", "item_id", "request",
                 "task")

    def __init__(self, base: dict[str, Any], item_id: str) -> None:
        self.base = base
        self.item_id = item_id
        self.request: SimRequest | None = None
        self.final: dict[str, Any] | None = None
        self.cancelled = False
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._delta_mid = (b'","item_id":"' + item_id.encode()
                           + b'","logprobs":[],"output_index":0,"sequence_number":')

    def notify(self, request: SimRequest) -> None:
        """The engine's progress callback: the final response is made with the last token."""
        if request.status is Status.FINISHED and self.final is None:
            self.final = finished_response(self.base, self.item_id, request)
        self.wake()

    def wake(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    @property
    def aborted(self) -> bool:
        return self.request is not None and self.request.status is Status.ABORTED

    @property
    def last_seq(self) -> int | None:
        if self.final is None:
            return None
        output_tokens: int = self.final["usage"]["output_tokens"]
        return FIRST_DELTA + output_tokens + 3

    async def wait_done(self) -> None:
        while self.final is None and not self.aborted:
            await self.changed.wait()

    def frames(self, start: int) -> Iterator[tuple[int, bytes, int]]:
        """(sequence number, frame, token index or -1) of every event there is from `start`."""
        produced = self.request.num_output_tokens if self.request is not None else 0
        final = self.final
        item_id = self.item_id
        if start <= 1:
            for seq, kind in ((0, "response.created"), (1, "response.in_progress")):
                if seq >= start:
                    yield seq, _event(kind, seq, response=self.base), -1
        if produced == 0:
            return
        if start <= 2:
            yield 2, _event("response.output_item.added", 2, output_index=0,
                            item=message_item(item_id, "", "in_progress")), -1
        if start <= 3:
            yield 3, _event("response.content_part.added", 3, content_index=0,
                            item_id=item_id, output_index=0, part=_text_part("", [])), -1
        words = sse.WORDS
        for i in range(max(0, start - FIRST_DELTA), produced):
            yield (FIRST_DELTA + i, _DELTA_HEAD + words[i % len(words)] + self._delta_mid
                   + str(FIRST_DELTA + i).encode() + _DELTA_TAIL, i)
        if final is None:
            return
        text = final["output"][0]["content"][0]["text"] if final["output"][0]["content"] else ""
        seq = FIRST_DELTA + produced
        tail: list[tuple[str, dict[str, Any]]] = [
            ("response.output_text.done", {"content_index": 0, "item_id": item_id,
                                           "logprobs": [], "output_index": 0, "text": text}),
            ("response.content_part.done", {"content_index": 0, "item_id": item_id,
                                            "output_index": 0,
                                            "part": _text_part(text, None)}),
            ("response.output_item.done", {"item": final["output"][0], "output_index": 0}),
            ("response.completed", {"response": final}),
        ]
        for k, (kind, fields) in enumerate(tail):
            if seq + k >= start:
                yield seq + k, _event(kind, seq + k, **fields), -1


async def pump(send: Send, run: Run, start: int, faults: RequestFaults | None = None,
               before_end: Callable[[], None] | None = None) -> bool:
    """Send a run's events from sequence number `start` as they happen, until
    response.completed (True) or the run is cut: aborted, or the drop fault (False, mid-body,
    so the connection is closed) or cancelled (False, the body ended)."""
    drop_after = faults.drop_after if faults is not None else None
    stall_after = faults.stall_after if faults is not None else None
    nxt = start
    while True:
        changed = run.changed
        if run.aborted and not run.cancelled:
            return False
        out: list[bytes] = []
        for seq, frame, token in run.frames(nxt):
            if token >= 0 and drop_after is not None and token >= drop_after:
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": True})
                return False
            if token >= 0 and stall_after is not None and token == stall_after:
                assert faults is not None
                stall_after = None
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": True})
                    out = []
                await asyncio.sleep(faults.stall_s)
            out.append(frame)
            nxt = seq + 1
        last = run.last_seq
        if last is not None and nxt > last:
            if before_end is not None:
                before_end()
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
            return True
        if run.cancelled:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
            return False
        if out:
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        if changed is run.changed:
            await changed.wait()


# -- the store ---------------------------------------------------------------------------------

@dataclass(eq=False, slots=True)
class Entry:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # its input as chat messages (vLLM's msg_store)
    run: Run | None = None  # a background response's run: to cancel it, to stream it
    streamable: bool = False  # created with background and stream: GET ?stream=true follows it
    size: int = 0
    expires: float = 0.0


class ResponseStore:
    """Stored responses by id, least recently updated first; bounded in count, age and bytes."""

    def __init__(self, max_entries: int, ttl_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self.bytes = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Entry | None:
        self._expire()
        return self._entries.get(response_id)

    def put(self, response_id: str, entry: Entry) -> None:
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        entry.size = len(orjson.dumps([entry.messages, entry.response["output"]]))
        entry.expires = self.clock() + self.ttl_s
        self._entries[response_id] = entry
        self.bytes += entry.size
        self._expire()
        while self._entries and (len(self._entries) > self.max_entries
                                 or self.bytes > self.max_bytes):
            self._pop_oldest()

    def _expire(self) -> None:
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size


# -- the handlers ------------------------------------------------------------------------------

class Responses:
    def __init__(self, app: Host) -> None:
        self.app = app
        options = app.options
        self.store = ResponseStore(options.responses_store_max, options.responses_store_ttl_s,
                                   options.responses_store_max_bytes)
        self._tasks: set[asyncio.Task[None]] = set()

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        arrival = asyncio.get_running_loop().time()
        raw = await read_body(receive)
        try:
            parsed = parse_responses(parse_json(raw))
            check_model(parsed.model, app.spec.served_model_name)
            prev: Entry | None = None
            if parsed.previous_response_id is not None:
                prev = self.store.get(parsed.previous_response_id)
                if prev is None:
                    raise not_found(parsed.previous_response_id)
            faults = app.faults.draw()
            if faults.fail:
                raise ApiError(500, "Simulated engine failure (fault injection: fail_rate).")
            limit = app.spec.max_model_len
            wanted = parsed.max_output_tokens
            if wanted is not None and wanted > limit:
                # vLLM's TokenizeParams check, its f-string included.
                raise bad_request(f"max_output_tokens={wanted}cannot be greater than "
                                  f"max_model_len=max_total_tokens={limit}. Please request "
                                  "fewer output tokens.", "max_output_tokens")
            messages = input_messages(parsed, prev)
            tools = function_tools(parsed.tools)
            tokens, hashes = await self._measure(messages, tools, parsed)
            tokens, max_tokens = fit(tokens, wanted, limit, parsed.truncation)
            response_id = parsed.request_id or f"resp_{uuid.uuid4().hex}"
            run = Run(response_object(parsed, response_id, int(time.time()),
                                      app.spec.served_model_name, max_tokens),
                      f"msg_{uuid.uuid4().hex}")
            run.request = await app.enter(arrival, response_id, tokens, hashes, max_tokens, 0,
                                          parsed.ignore_eos, run.notify)
        except ApiError as exc:
            await respond(send, exc.status, exc.body())
            return
        if parsed.background:
            await self._background(send, receive, parsed, run, messages)
        else:
            await self._foreground(send, receive, parsed, run, messages, faults)

    async def _measure(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       parsed: ResponsesParsed) -> tuple[int, list[int]]:
        app = self.app
        assert app.counter is not None, "Host.startup() was not run"
        # ResponsesRequest.build_chat_params: a partial assistant message last is continued.
        continue_final = continues_final_message(parsed.input)
        kwargs: dict[str, Any] = {"add_generation_prompt": not continue_final,
                                  "continue_final_message": continue_final}
        effort = (parsed.reasoning or {}).get("effort")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        try:
            stripped, images = split_images(messages, "input")
            normalized = openai_messages(stripped)
            tokens = await app.counter.count_chat(normalized, tools, **kwargs)
        except ImageError as exc:
            raise bad_request(str(exc), exc.param) from None
        except RequestCostError as exc:
            raise bad_request(str(exc), "input") from None
        tokens += len(images) * app.options.image_tokens
        spec = app.spec
        if not spec.enable_prefix_caching:
            return tokens, []
        if parsed.prefix_hash_ids is not None:
            return tokens, prompts.from_hash_ids(parsed.prefix_hash_ids,
                                                 spec.prefix_hash_block_size, tokens,
                                                 spec.block_size)
        return tokens, prompts.from_messages(keyed(normalized, images), tools, tokens,
                                             spec.block_size)

    async def _foreground(self, send: Send, receive: Receive, parsed: ResponsesParsed, run: Run,
                          messages: list[dict[str, Any]], faults: RequestFaults) -> None:
        request = run.request
        assert request is not None

        def gone() -> None:
            self.app.release(request)
            run.wake()

        def store() -> None:
            if parsed.store and run.final is not None:
                self.store.put(run.final["id"], Entry(run.final, messages))

        watcher = asyncio.create_task(watch_disconnect(receive, gone))
        try:
            if parsed.stream:
                await send({"type": "http.response.start", "status": 200,
                            "headers": SSE_HEADERS})
                await pump(send, run, 0, faults, store)
                return
            await run.wait_done()
            if run.final is None:
                return  # the client left, or the engine "crashed"
            if faults.stall_after is not None:
                await asyncio.sleep(faults.stall_s)
            body = orjson.dumps(run.final)
            if faults.drop_after is not None:
                await respond_cut(send, body)
                return
            store()
            await respond(send, 200, body)
        except OSError:
            pass  # the client went away mid-write
        finally:
            watcher.cancel()
            self.app.release(request)

    async def _background(self, send: Send, receive: Receive, parsed: ResponsesParsed, run: Run,
                          messages: list[dict[str, Any]]) -> None:
        entry = Entry({**run.base, "status": "queued"}, messages, run, streamable=parsed.stream)
        response_id = run.base["id"]
        self.store.put(response_id, entry)
        task = asyncio.create_task(self._finish_background(response_id, entry))
        run.task = task
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)
        if parsed.stream:
            await self._follow(send, receive, run, 0)
        else:
            await respond(send, 200, orjson.dumps(entry.response))

    async def _finish_background(self, response_id: str, entry: Entry) -> None:
        run = entry.run
        assert run is not None and run.request is not None
        try:
            await run.wait_done()
        finally:
            self.app.release(run.request)  # cancelled: out of the engine
        if run.cancelled:
            return
        # An engine "crash" (the down fault) fails it, as vLLM marks a failed background run.
        entry.response = run.final if run.final is not None else {**entry.response,
                                                                  "status": "failed"}
        self.store.put(response_id, entry)

    async def _follow(self, send: Send, receive: Receive, run: Run, start: int) -> None:
        """Stream a background run's events; the client leaving stops the stream, not the run."""
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        task = asyncio.ensure_future(pump(send, run, start))
        watcher = asyncio.create_task(watch_disconnect(receive, task.cancel))
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        except OSError:
            pass
        finally:
            watcher.cancel()

    async def retrieve(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = scope["path"][len(RESPONSES_PREFIX):]
        params = query(scope)
        entry = self.store.get(response_id)
        try:
            if entry is None:
                raise not_found(response_id)
            stream = params.get("stream", "false").lower() in ("true", "1", "yes", "on")
            start = 0
            if stream:
                if entry.run is None or not entry.streamable:
                    raise bad_request(f"Unknown response_id: {response_id}", "response_id")
                after = params.get("starting_after")
                if after is not None:
                    try:
                        start = int(after) + 1
                    except ValueError:
                        raise bad_request("starting_after: must be an integer",
                                          "starting_after") from None
        except ApiError as exc:
            await respond(send, exc.status, exc.body())
            return
        if stream and entry.run is not None:
            await self._follow(send, receive, entry.run, max(start, 0))
        else:
            await respond(send, 200, orjson.dumps(entry.response))

    async def cancel(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = scope["path"][len(RESPONSES_PREFIX):-len("/cancel")]
        entry = self.store.get(response_id)
        if entry is None:
            await respond(send, 404, not_found(response_id).body())
            return
        if entry.response.get("status") not in CANCELLABLE:
            await respond(send, 400, ApiError(400, "Cannot cancel a synchronous response.",
                                              "response_id", INVALID).body())
            return
        entry.response = {**entry.response, "status": "cancelled"}
        run = entry.run
        if run is not None:
            run.cancelled = True
            if run.request is not None:
                self.app.release(run.request)
            run.wake()
            if run.task is not None:
                run.task.cancel()
        await respond(send, 200, orjson.dumps(entry.response))

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def fit(tokens: int, wanted: int | None, max_model_len: int,
        truncation: str) -> tuple[int, int]:
    """vLLM's length checks for a Responses prompt (TokenizeParams, `_validate_generator_input`)
    and the output limit it then gets (`get_max_tokens`): (prompt tokens, max tokens)."""
    max_input = max_model_len - (wanted or 0)
    if truncation == "auto":
        tokens = min(tokens, max_input)  # truncate_prompt_tokens=-1: cut to what fits
    elif tokens > max_input:
        raise bad_request(
            f"You passed {tokens} input tokens and requested {wanted or 0} output tokens. "
            f"However, the model's context length is only {max_model_len} tokens, resulting in "
            f"a maximum input length of {max_input} tokens. Please reduce the length of the "
            "input prompt.", "input_tokens")
    if tokens >= max_model_len:
        raise ApiError(400, f"The engine prompt length {tokens} exceeds the max_model_len "
                       f"{max_model_len}. Please reduce prompt.", "input", INVALID)
    room = max_model_len - tokens
    return tokens, room if wanted is None else min(wanted, room)
