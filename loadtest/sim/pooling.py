"""vLLM's pooling endpoints beyond embeddings: `POST /v1/rerank`, `/v1/score`, `/classify`,
`/pooling` (vllm/entrypoints/pooling/: scoring/, classify/, pooling/), as a pooling model serves
them.

A rerank or score pair is one engine request whose prompt is both inputs (a cross-encoder's
pair; the simulated tokenizer's pair format adds no tokens, as Qwen's adds none): a query
against N documents is N requests, its tokens counted in each. `/classify` and `/pooling` take
an embedding's `input` or `messages` (parse_embeddings), one request per prompt. Every request
is a prefill that queues and saturates with the chat traffic (embeddings.py `serve_prefills`);
`usage` has prompt tokens only, as vLLM's.

Scores, class probabilities and pooled vectors are functions of the input's hash: repeatable,
meaningless. `/pooling` answers the `embed` task's vector; an IO-processor plugin's `data` is
refused (the simulator has none).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.sim import prompts
from loadtest.sim.asgi import Receive, Scope, Send
from loadtest.sim.embeddings import Measured, pseudo_embedding, serve_prefills
from loadtest.sim.host import Host
from loadtest.sim.multimodal import IMAGE_PARTS
from loadtest.sim.protocol import (
    EmbeddingsParsed,
    bad_request,
    check_model,
    parse_embeddings,
)

# The names a score request may give its two sides, in the order vLLM's union tries them.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))
CLASS_LABELS = ("LABEL_0", "LABEL_1")


def unit_score(key: bytes) -> float:
    """A repeatable number in (0, 1) for `key`."""
    return (int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") + 1) / (2**64 + 2)


@dataclass(frozen=True, slots=True)
class Pairs:
    model: str | None
    first: list[Any]  # each a string or {"content": [parts]}
    second: list[Any]
    top_n: int = 0
    rerank: bool = False

    def pairs(self) -> list[tuple[Any, Any]]:
        if len(self.first) == 1:
            return [(self.first[0], s) for s in self.second]
        return list(zip(self.first, self.second, strict=True))


def _inputs(value: object, name: str) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, Mapping)
                                          and isinstance(item.get("content"), list))):
            raise bad_request(f"{name}: each input must be a string or an object with a "
                              "`content` list of parts", name)
    return list(items)


def _model(body: Mapping[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model: must be a string", "model")
    return model


def parse_pairs(body: Mapping[str, Any], rerank: bool) -> Pairs:
    """vLLM's RerankRequest or ScoreRequest, and its pairing rule (scoring/utils.py)."""
    if rerank:
        if "query" not in body or "documents" not in body:
            raise bad_request("query and documents are required", "query")
        query = body["query"]
        if isinstance(query, list):
            raise bad_request("query: must be a string or an object with `content`", "query")
        first, second = _inputs(query, "query"), _inputs(body["documents"], "documents")
    else:
        for a, b in SCORE_SIDES:
            if a in body and b in body:
                first, second = _inputs(body[a], a), _inputs(body[b], b)
                break
        else:
            raise bad_request("text_1 and text_2 (or queries and documents) are required",
                              "text_1")
    if not first:
        raise bad_request("At least one text element must be given")
    if not second:
        raise bad_request("At least one text_pair element must be given")
    if len(first) > 1 and len(first) != len(second):
        raise bad_request("Input lengths must be either 1:1, 1:N or N:N")
    top_n = body.get("top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise bad_request("top_n: must be a non-negative integer", "top_n")
    return Pairs(_model(body), first, second, top_n, rerank)


class Pooling:
    """The handlers of /v1/rerank, /v1/score, /classify and /pooling."""

    def __init__(self, app: Host, measure_prompts: Callable[
            [EmbeddingsParsed], Awaitable[list[tuple[int, list[int], bytes]]]]) -> None:
        self.app = app
        self._measure_prompts = measure_prompts  # Embeddings.measure

    async def rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_prefills(self.app, receive, send, lambda b: self._pairs(b, True),
                             self._measure_pairs)

    async def score(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_prefills(self.app, receive, send, lambda b: self._pairs(b, False),
                             self._measure_pairs)

    async def classify(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_prefills(self.app, receive, send, lambda b: self._inputs(b, False),
                             lambda p: self._measure_inputs(p, "classify"))

    async def pooling(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve_prefills(self.app, receive, send, lambda b: self._inputs(b, True),
                             lambda p: self._measure_inputs(p, "pool"))

    def _pairs(self, body: Mapping[str, Any], rerank: bool) -> Pairs:
        parsed = parse_pairs(body, rerank)
        check_model(parsed.model, self.app.spec.served_model_name)
        return parsed

    def _inputs(self, body: Mapping[str, Any], pooling: bool) -> EmbeddingsParsed:
        parsed = _parse_pooling(body) if pooling else parse_embeddings(body)
        check_model(parsed.model, self.app.spec.served_model_name)
        return parsed

    async def _measure_pairs(self, parsed: Pairs) -> tuple[list[Measured], Callable[[], bytes]]:
        app = self.app
        counter = app.counter
        assert counter is not None, "Host.startup() was not run"
        texts: dict[str, int] = {}
        for item in (*parsed.first, *parsed.second):
            texts.setdefault(self._text(item), 0)
        for text in texts:
            texts[text] = await counter.count_text(text)
        block, caching, limit = (app.spec.block_size, app.spec.enable_prefix_caching,
                                 app.spec.max_model_len)
        measured: list[Measured] = []
        keys: list[bytes] = []
        for a, b in parsed.pairs():
            ta, tb = self._text(a), self._text(b)
            tokens = texts[ta] + texts[tb] + self._images(a) + self._images(b)
            if tokens > limit:
                raise bad_request(
                    f"You passed {tokens} input tokens and requested 0 output tokens. However, "
                    f"the model's context length is only {limit} tokens, resulting in a maximum "
                    f"input length of {limit} tokens. Please reduce the length of the input "
                    "prompt.", "input_tokens")
            key = orjson.dumps([a, b], option=orjson.OPT_SORT_KEYS)
            hashes = prompts.from_text(ta + "\0" + tb, tokens, block) if caching else []
            measured.append((tokens, hashes))
            keys.append(key)
        prefix = "rerank" if parsed.rerank else "score"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        total = sum(t for t, _ in measured)
        model = app.spec.served_model_name

        def body() -> bytes:
            scores = [unit_score(k) for k in keys]
            if not parsed.rerank:
                return orjson.dumps({
                    "id": request_id, "object": "list", "created": int(time.time()),
                    "model": model,
                    "data": [{"index": i, "object": "score", "score": s}
                             for i, s in enumerate(scores)],
                    "usage": _usage(total)})
            # Sorted by relevance, the top_n kept (0: all), as vLLM's rerank answers.
            order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
            if 0 < parsed.top_n < len(order):
                order = order[:parsed.top_n]
            results = [{"index": i, "document": _document(parsed.second[i]),
                        "relevance_score": scores[i]} for i in order]
            return orjson.dumps({"id": request_id, "model": model, "results": results,
                                 "usage": {"prompt_tokens": total, "total_tokens": total}})

        return measured, body

    async def _measure_inputs(self, parsed: EmbeddingsParsed, kind: str
                              ) -> tuple[list[Measured], Callable[[], bytes]]:
        app = self.app
        checked = await self._measure_prompts(parsed)
        measured: list[Measured] = [(tokens, hashes) for tokens, hashes, _ in checked]
        keys = [key for _, _, key in checked]
        request_id = f"{kind}-{uuid.uuid4().hex}"
        total = sum(t for t, _ in measured)
        model = app.spec.served_model_name
        dim = app.options.embedding_dim

        def body() -> bytes:
            data: list[dict[str, Any]] = []
            for index, key in enumerate(keys):
                if kind == "classify":
                    p = unit_score(key)
                    data.append({"index": index, "label": CLASS_LABELS[p >= 0.5],
                                 "probs": [1.0 - p, p], "num_classes": len(CLASS_LABELS)})
                else:
                    data.append({"index": index, "object": "pooling",
                                 "data": pseudo_embedding(key, dim)})
            return orjson.dumps({"id": request_id, "object": "list",
                                 "created": int(time.time()), "model": model, "data": data,
                                 "usage": _usage(total)})

        return measured, body

    @staticmethod
    def _text(item: Any) -> str:
        if isinstance(item, str):
            return item
        return "\n".join(str(p.get("text", "")) for p in item["content"]
                         if isinstance(p, Mapping) and p.get("type") == "text")

    def _images(self, item: Any) -> int:
        if isinstance(item, str):
            return 0
        return self.app.options.image_tokens * sum(
            1 for p in item["content"] if isinstance(p, Mapping)
            and p.get("type") in IMAGE_PARTS)


def _parse_pooling(body: Mapping[str, Any]) -> EmbeddingsParsed:
    if "data" in body and "input" not in body and "messages" not in body:
        raise bad_request("The simulated model has no IO processor plugin: send `input` or "
                          "`messages`", "data")
    task = body.get("task")
    if task not in (None, "embed"):
        raise bad_request(f"Task {task!r} is not supported by the simulated model (it pools "
                          "with `embed`)", "task")
    return parse_embeddings(body)


def _document(doc: Any) -> dict[str, Any]:
    if isinstance(doc, str):
        return {"text": doc, "multi_modal": None}
    return {"text": None, "multi_modal": doc["content"]}


def _usage(total: int) -> dict[str, Any]:
    return {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
            "prompt_tokens_details": None}

