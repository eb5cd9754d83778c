"""`POST /v1/embeddings`, as vLLM's pooling server answers it (vllm/entrypoints/pooling/embed/:
openai_protocol.py, serving.py; pooling/utils.py for the encodings).

`input` is a string, a list of strings, a list of token ids or a list of lists of token ids (one
engine request per prompt, as vLLM schedules a batch), or `messages` are rendered with the chat
template (vLLM's EmbeddingChatRequest, no generation prompt by default). Each prompt costs its
prefill in the simulated engine: it enters the scheduler as a request of its prompt tokens that
finishes with the token after its prefill (a pooling request stops after prefill; here the one
"sampled" token stands for the pooler's output), so embeddings queue and saturate with the chat
traffic.

The vectors are pseudo-embeddings: `embedding_dim` floats drawn from a hash of the input
(deterministic across runs and processes) and L2-normalised, exactly representable in float32 so
that `encoding_format: "base64"` (what the `openai` SDK asks for unless told otherwise: float32
bytes in native order, base64) decodes to the same numbers as "float". `dimensions` takes the
first that many and normalises again (the model is treated as matryoshka); vLLM's `embed_dtype`
(float32, float16, bfloat16) and `endianness` shape the base64 bytes.
"""

from __future__ import annotations

import array
import asyncio
import base64
import hashlib
import math
import struct
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from gateway.cost import RequestCostError
from gateway.tokens import openai_messages
from loadtest.sim import prompts
from loadtest.sim.asgi import (
    Receive,
    Scope,
    Send,
    read_body,
    respond,
    respond_cut,
    watch_disconnect,
)
from loadtest.sim.host import Host
from loadtest.sim.multimodal import keyed
from loadtest.sim.protocol import (
    ApiError,
    EmbeddingsParsed,
    bad_request,
    check_model,
    parse_embeddings,
    parse_json,
)
from loadtest.sim.scheduler import SimRequest, Status


def pseudo_embedding(key: bytes, dim: int) -> list[float]:
    """A unit vector of `dim` float32-exact values, a function of `key` alone."""
    raw = hashlib.shake_256(key).digest(4 * dim)
    values = [u / 2**31 - 1.0 for u in struct.unpack(f"<{dim}I", raw)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return array.array("f", [v / norm for v in values]).tolist()


def truncate(vector: list[float], dimensions: int) -> list[float]:
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return array.array("f", [v / norm for v in head]).tolist()


def to_base64(vector: list[float], embed_dtype: str, endianness: str) -> str:
    """vLLM's `encode_pooling_output_base64`: the tensor's bytes in that dtype and byte order."""
    little = sys.byteorder == "little" if endianness == "native" else endianness == "little"
    order = "<" if little else ">"
    n = len(vector)
    if embed_dtype == "float16":
        raw = struct.pack(f"{order}{n}e", *vector)
    elif embed_dtype == "bfloat16":
        bits = struct.unpack(f"<{n}I", struct.pack(f"<{n}f", *vector))
        # Round to nearest even on the dropped 16 bits, as torch's float32 -> bfloat16 does.
        halves = [((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF for b in bits]
        raw = struct.pack(f"{order}{n}H", *halves)
    else:
        raw = struct.pack(f"{order}{n}f", *vector)
    return base64.b64encode(raw).decode("ascii")


class _Progress:
    """Wakes the handler when any of its requests made progress."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()

    def notify(self, _request: SimRequest | None = None) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()


# A prefill's prompt tokens and the hashes of its full blocks.
Measured = tuple[int, list[int]]


P = TypeVar("P")


async def serve_prefills(
        app: Host, receive: Receive, send: Send, parse: Callable[[dict[str, Any]], P],
        measure: Callable[[P], Awaitable[tuple[list[Measured], Callable[[], bytes]]]]) -> None:
    """One pooling request (an embedding, a rerank, a score, a classification): its body
    parsed, the fault drawn, its prompts measured and entered into the engine as prefills, and
    once all are done the answer `measure` built for them, or the error in vLLM's shape."""
    arrival = asyncio.get_running_loop().time()
    raw = await read_body(receive)
    entered: list[SimRequest] = []
    progress = _Progress()
    try:
        parsed = parse(parse_json(raw))
        faults = app.faults.draw()
        if faults.fail:
            raise ApiError(500, "Simulated engine failure (fault injection: fail_rate).")
        measured, body = await measure(parsed)
        request_id = uuid.uuid4().hex
        for index, (tokens, hashes) in enumerate(measured):
            # max_tokens 1, ignore_eos: the request ends with the token after its prefill.
            entered.append(await app.enter(arrival, f"{request_id}-{index}", tokens,
                                           hashes, 1, 0, True, progress.notify))
    except ApiError as exc:
        for request in entered:
            app.release(request)
        await respond(send, exc.status, exc.body())
        return

    def gone() -> None:
        for request in entered:
            app.release(request)
        progress.notify()

    watcher = asyncio.create_task(watch_disconnect(receive, gone))
    try:
        while not all(r.finished for r in entered):
            await progress.changed.wait()
        if any(r.status is Status.ABORTED for r in entered):
            return  # the client left, or the engine "crashed"
        answer = body()
        if faults.stall_after is not None:
            await asyncio.sleep(faults.stall_s)
        if faults.drop_after is not None:
            await respond_cut(send, answer)
            return
        await respond(send, 200, answer)
    except OSError:
        pass
    finally:
        watcher.cancel()
        for request in entered:
            app.release(request)


class Embeddings:
    def __init__(self, app: Host) -> None:
        self.app = app
        self._specials: int | None = None

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_prefills(self.app, receive, send, self._parse, self._measured)

    def _parse(self, body: dict[str, Any]) -> EmbeddingsParsed:
        parsed = parse_embeddings(body)
        check_model(parsed.model, self.app.spec.served_model_name)
        return parsed

    async def _measured(self, parsed: EmbeddingsParsed
                        ) -> tuple[list[Measured], Callable[[], bytes]]:
        dim = self.app.options.embedding_dim
        if parsed.dimensions is not None and not 1 <= parsed.dimensions <= dim:
            raise bad_request(
                "Dimensions must be greater than 0" if parsed.dimensions < 1 else
                f"dimensions: the simulated model's embeddings have {dim} dimensions, "
                f"got {parsed.dimensions}", "dimensions")
        measured = await self.measure(parsed)
        embedding_id = f"embd-{uuid.uuid4().hex}"
        return ([(tokens, hashes) for tokens, hashes, _ in measured],
                lambda: self._body(parsed, embedding_id, measured))

    async def measure(self, parsed: EmbeddingsParsed) -> list[tuple[int, list[int], bytes]]:
        """(prompt tokens, block hashes, vector key) of each prompt; checks their lengths."""
        app = self.app
        counter = app.counter
        assert counter is not None, "Host.startup() was not run"
        spec = app.spec
        block = spec.block_size
        caching = spec.enable_prefix_caching
        out: list[tuple[int, list[int], bytes]] = []
        try:
            if parsed.messages is not None:
                normalized = openai_messages(parsed.messages)
                tokens = await counter.count_chat(normalized, None, **parsed.template_kwargs)
                tokens += len(parsed.images) * app.options.image_tokens
                hashes = (prompts.from_messages(keyed(normalized, parsed.images), None, tokens,
                                                block) if caching else [])
                key = b"chat\0" + orjson.dumps([normalized, parsed.images],
                                               option=orjson.OPT_SORT_KEYS)
                out.append((tokens, hashes, key))
            for prompt in parsed.prompts:
                if isinstance(prompt, str):
                    tokens = await counter.count_text(prompt)
                    if not parsed.add_special_tokens:
                        tokens -= self._special_tokens()
                    hashes = prompts.from_text(prompt, tokens, block) if caching else []
                    key = b"text\0" + prompt.encode()
                else:
                    tokens = len(prompt)
                    hashes = prompts.from_token_ids(prompt, block) if caching else []
                    key = b"ids\0" + ",".join(map(str, prompt)).encode()
                out.append((tokens, hashes, key))
        except RequestCostError as exc:
            raise bad_request(str(exc), exc.param) from None
        limit = spec.max_model_len
        cut = parsed.truncate_prompt_tokens
        if cut is not None and cut > limit:
            # vLLM's TokenizeParams message, parameter names as the embeddings request sets them.
            raise bad_request(f"truncate_prompt_tokens={cut} cannot be greater than "
                              f"max_model_len - max_model_len - max_embed_len = {limit}. "
                              "Please request a smaller truncation size.",
                              "truncate_prompt_tokens")
        checked: list[tuple[int, list[int], bytes]] = []
        for tokens, hashes, key in out:
            if cut is not None:
                tokens = min(tokens, limit if cut == -1 else cut)
                hashes = hashes[:tokens // block]
            if tokens > limit:
                raise bad_request(
                    f"You passed {tokens} input tokens and requested 0 output tokens. However, "
                    f"the model's context length is only {limit} tokens, resulting in a maximum "
                    f"input length of {limit} tokens. Please reduce the length of the input "
                    "prompt.", "input_tokens")
            if tokens == 0:
                raise bad_request("The decoder prompt cannot be empty", "input")
            checked.append((tokens, hashes, key))
        return checked

    def _special_tokens(self) -> int:
        """Tokens the tokenizer adds to every encoded text (a BOS for Llama, none for Qwen)."""
        if self._specials is None:
            tokenizer = self.app.tokenizer
            self._specials = tokenizer.count_text("") if tokenizer is not None else 0
        return self._specials

    def _body(self, parsed: EmbeddingsParsed, embedding_id: str,
              measured: list[tuple[int, list[int], bytes]]) -> bytes:
        dim = self.app.options.embedding_dim
        data: list[dict[str, Any]] = []
        for index, (_tokens, _hashes, key) in enumerate(measured):
            vector = pseudo_embedding(key, dim)
            if parsed.dimensions is not None and parsed.dimensions < dim:
                vector = truncate(vector, parsed.dimensions)
            encoded: list[float] | str = (
                vector if parsed.encoding_format == "float"
                else to_base64(vector, parsed.embed_dtype, parsed.endianness))
            data.append({"index": index, "object": "embedding", "embedding": encoded})
        prompt_tokens = sum(tokens for tokens, _, _ in measured)
        return orjson.dumps({
            "id": embedding_id, "object": "list", "created": int(time.time()),
            "model": self.app.spec.served_model_name, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        })
