"""Response bodies in vLLM's wire format, built from pre-encoded pieces.

A streamed token costs two bytes concatenations: the request's frame prefix (id, model, created
already in it), the token's pre-escaped text, and a constant suffix. No dict, no JSON encoder.
Chunks are byte-identical in shape to vLLM's (`model_dump_json(exclude_unset=True)`):

    data: {"id":"chatcmpl-..","object":"chat.completion.chunk","created":..,"model":"..",
           "choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,"finish_reason":null}]}

The output text is filler: one word per token, so its token count is exact by construction.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_WORDS = ("the", "of", "a", "model", "engine", "token", "and", "to", "is", "in", "simulated",
          "output", "for", "with", "cache", "block", "step", "that", "on", "request")
# One leading space each, as a BPE vocabulary emits words; JSON-escaped once.
WORDS: tuple[bytes, ...] = tuple(orjson.dumps(" " + w)[1:-1] for w in _WORDS)


def filler_text(tokens: int) -> str:
    n = len(_WORDS)
    return "".join(" " + _WORDS[i % n] for i in range(tokens))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    # vLLM (entrypoints/openai/serving_chat.py, serving_completion.py) fills
    # prompt_tokens_details only with --enable-prompt-tokens-details and a non-zero hit:
    # PromptTokenUsageInfo(cached_tokens=num_cached_tokens). The caller passes 0 for "off".
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None}


class Frames:
    """SSE frames of one streamed response (chat.completion.chunk or text_completion)."""

    __slots__ = ("_chat", "_head", "_tok_head", "_tok_mid", "_tok_tail")

    def __init__(self, chat: bool, request_id: str, model: str, created: int | None = None) -> None:
        self._chat = chat
        created = int(time.time()) if created is None else created
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":"{request_id}","object":"{obj}","created":{created},'
                      f'"model":').encode() + orjson.dumps(model)
        if chat:
            self._tok_head = self._head + b',"choices":[{"index":0,"delta":{"content":"'
            self._tok_mid = b'"},"logprobs":null,"finish_reason":'
            self._tok_tail = b'null}]}\n\n'
        else:
            self._tok_head = self._head + b',"choices":[{"index":0,"text":"'
            self._tok_mid = b'","logprobs":null,"finish_reason":'
            self._tok_tail = b'null,"stop_reason":null}]}\n\n'

    def role(self) -> bytes:
        """vLLM's first chat chunk: the assistant role with empty content."""
        return (self._head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]}\n\n')

    def token(self, index: int) -> bytes:
        return self._tok_head + WORDS[index % len(WORDS)] + self._tok_mid + self._tok_tail

    def last_token(self, index: int, finish_reason: str) -> bytes:
        return (self._tok_head + WORDS[index % len(WORDS)] + self._tok_mid
                + f'"{finish_reason}","stop_reason":null}}]}}\n\n'.encode())

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        return (self._head + b',"choices":[],"usage":'
                + orjson.dumps(usage(prompt_tokens, completion_tokens, cached_tokens))
                + b"}\n\n")


def chat_response(request_id: str, model: str, prompt_tokens: int, completion_tokens: int,
                  finish_reason: str, cached_tokens: int = 0) -> bytes:
    return orjson.dumps({
        "id": request_id, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": filler_text(completion_tokens),
                                 "refusal": None, "annotations": None, "audio": None,
                                 "function_call": None, "tool_calls": [],
                                 "reasoning_content": None},
                     "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens), "prompt_logprobs": None,
        "kv_transfer_params": None,
    })


def completion_response(request_id: str, model: str, prompt_tokens: int, completion_tokens: int,
                        finish_reason: str, cached_tokens: int = 0) -> bytes:
    return orjson.dumps({
        "id": request_id, "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": filler_text(completion_tokens), "logprobs": None,
                     "finish_reason": finish_reason, "stop_reason": None,
                     "prompt_logprobs": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens), "kv_transfer_params": None,
    })
