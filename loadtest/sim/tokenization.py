"""`POST /tokenize` and `POST /detokenize`, as vLLM's server answers them
(vllm/entrypoints/serve/tokenize/: protocol.py, serving.py).

    {"model", "prompt", "add_special_tokens": true}                        -> count, tokens
    {"model", "messages", "add_generation_prompt": true, "tools", ...}      -> the chat template
                                                                              rendered, encoded
    answer: {"count", "max_model_len", "tokens", "token_strs"}  (token_strs with return_token_strs)
    {"model", "tokens"} -> {"prompt"}

They need an exact tokenizer (a `--tokenizer` other than `none`), and never touch the engine.
Image parts cannot be tokenized here: the simulated model has no image placeholder tokens (an
image's cost is counted by the generation endpoints instead).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.cost import RequestCostError, TokenizerError
from gateway.tokens import HFTokenizer, openai_messages
from loadtest.sim.asgi import Receive, Scope, Send, read_body, respond
from loadtest.sim.host import Host
from loadtest.sim.multimodal import ImageError, split_images
from loadtest.sim.protocol import (
    ApiError,
    TokenizeParsed,
    bad_request,
    check_model,
    parse_detokenize,
    parse_json,
    parse_tokenize,
)


class Tokenization:
    def __init__(self, app: Host) -> None:
        self.app = app

    def _tokenizer(self) -> HFTokenizer:
        tokenizer = self.app.tokenizer
        if not isinstance(tokenizer, HFTokenizer):
            name = getattr(tokenizer, "name", None)
            raise bad_request(f"tokenizer {name!r} only estimates counts, it cannot encode or "
                              "decode: start the simulator with an exact --tokenizer")
        return tokenizer

    async def tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        try:
            parsed = parse_tokenize(parse_json(raw))
            check_model(parsed.model, self.app.spec.served_model_name)
            tokenizer = self._tokenizer()
            ids = await asyncio.to_thread(_encode, tokenizer, parsed)
        except ApiError as exc:
            await respond(send, exc.status, exc.body())
            return
        strs: list[str] | None = None
        if parsed.return_token_strs:
            # convert_ids_to_tokens, as vLLM answers: the vocabulary's pieces, not decoded text.
            rust: Any = getattr(tokenizer, "_rust", None)
            strs = ([rust.id_to_token(i) or "" for i in ids] if rust is not None
                    else [tokenizer.decode([i]) for i in ids])
        await respond(send, 200, orjson.dumps({
            "count": len(ids), "max_model_len": self.app.spec.max_model_len, "tokens": ids,
            "token_strs": strs}))

    async def detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        try:
            model, tokens = parse_detokenize(parse_json(raw))
            check_model(model, self.app.spec.served_model_name)
            tokenizer = self._tokenizer()
            rust: Any = getattr(tokenizer, "_rust", None)
            if rust is not None and tokens:
                size = rust.get_vocab_size(with_added_tokens=True)
                out_of_vocab = [t for t in tokens if t >= size]
                if out_of_vocab:
                    raise bad_request(f"Token id {max(out_of_vocab)} is out of vocabulary",
                                      "tokens")
            text = await asyncio.to_thread(tokenizer.decode, tokens)
        except ApiError as exc:
            await respond(send, exc.status, exc.body())
            return
        await respond(send, 200, orjson.dumps({"prompt": text}))


def _encode(tokenizer: HFTokenizer, parsed: TokenizeParsed) -> list[int]:
    """Token ids of the prompt, or of the rendered chat (in a worker thread)."""
    if parsed.messages is None:
        return tokenizer.encode_text(parsed.prompt or "",
                                     add_special_tokens=parsed.add_special_tokens)
    try:
        messages, images = split_images(parsed.messages)
        if images:
            raise bad_request("messages: image parts cannot be tokenized by the simulator (its "
                              "tokenizer has no image placeholder tokens)", "messages")
        text = tokenizer.render_chat(openai_messages(messages), parsed.tools,
                                     **parsed.template_kwargs)
    except ImageError as exc:
        raise bad_request(str(exc), exc.param) from None
    except RequestCostError as exc:
        raise bad_request(str(exc), exc.param) from None
    except TokenizerError as exc:  # a tokenizer without a chat template
        raise bad_request(str(exc), "messages") from None
    return tokenizer.encode_text(text, add_special_tokens=parsed.add_special_tokens)
