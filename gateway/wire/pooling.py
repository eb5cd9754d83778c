"""vLLM's pooling endpoints the gateway admits, as far as it reads their bodies.

    POST /v1/rerank   a query against documents          vllm/entrypoints/pooling/scoring/
    POST /v1/score    pairs of texts (1:1, 1:N or N:N)   vllm/entrypoints/pooling/scoring/
    POST /classify    texts or a chat, classified        vllm/entrypoints/pooling/classify/

Each is prefill work and nothing else: the engine runs every prompt through the model once and
pools what comes out; nothing is decoded. They are admitted as an embedding is (counted input,
an output limit of 0) because their input is text the gateway counts as cheaply as the engine
tokenizes it: a pair is the query's tokens and the document's (each text encoded once, however
many pairs it is in), `/classify`'s input an embedding's or a chat's. A pair's count is an
estimate: the model's pair format adds its own tokens (a cross-encoder's separators, a
reranker's score template).

`POST /pooling` is not here: it is passed through (gateway/api/passthrough.py), since what it
costs depends on its `task` and, for IO-processor plugins, on `data` of the plugin's own shape
(images, tiles, anything) that no tokenizer counts.

Bodies are held to vLLM's request models as far as the count needs; unknown fields pass through
(vLLM's `truncate_prompt_tokens`, `use_activation`, ...). vLLM's `model` is optional; here it
names the pool, so it is required, as for every endpoint the gateway admits.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from gateway.errors import InvalidRequest
from gateway.wire.prefill import PrefillOnly


class _Pooling(PrefillOnly, BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr



class ScoreContent(BaseModel):
    """vLLM's ScoreMultiModalParam: an input given as content parts."""

    model_config = ConfigDict(extra="allow")

    content: list[dict[str, Any]]


ScoreInput = StrictStr | ScoreContent
ScoreInputs = ScoreInput | list[ScoreInput]


def _listed(value: ScoreInputs) -> list[ScoreInput]:
    return value if isinstance(value, list) else [value]


def _pairs(first: list[ScoreInput], second: list[ScoreInput], param: str
           ) -> list[tuple[ScoreInput, ScoreInput]]:
    """vLLM's pairing (scoring/utils.py `_validate_score_input_lens`): one first input against
    every second, or as many of each, zipped; its messages."""
    if not first:
        raise InvalidRequest("At least one text element must be given", param=param,
                             code="invalid_value")
    if not second:
        raise InvalidRequest("At least one text_pair element must be given", param=param,
                             code="invalid_value")
    if len(first) > 1 and len(first) != len(second):
        raise InvalidRequest("Input lengths must be either 1:1, 1:N or N:N", param=param,
                             code="invalid_value")
    if len(first) == 1:
        return [(first[0], s) for s in second]
    return list(zip(first, second, strict=True))


class RerankRequest(_Pooling):
    query: ScoreInput
    documents: ScoreInputs
    top_n: Annotated[StrictInt, Field(ge=0)] | None = None

    def pairs(self) -> list[tuple[ScoreInput, ScoreInput]]:
        return _pairs([self.query], _listed(self.documents), "documents")


# The names a score request may give its two sides, in the order vLLM's union tries them.
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                ("text_1", "text_2"))


class ScoreRequest(_Pooling):
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None

    def pairs(self) -> list[tuple[ScoreInput, ScoreInput]]:
        for first, second in _SCORE_SIDES:
            a, b = getattr(self, first), getattr(self, second)
            if a is not None and b is not None:
                return _pairs(_listed(a), _listed(b), second)
        raise InvalidRequest("'text_1' and 'text_2' are required properties (or 'queries' and "
                             "'documents', 'queries' and 'items', 'data_1' and 'data_2').",
                             param="text_1", code="invalid_value")


class ClassifyMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: Any = None


class ClassifyRequest(_Pooling):
    """vLLM's ClassificationCompletionRequest (`input`, as an embedding's) or
    ClassificationChatRequest (`messages`, rendered with the chat template)."""

    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = None
    messages: Annotated[list[ClassifyMessage], Field(min_length=1)] | None = None

    def check(self) -> None:
        if self.input is None and self.messages is None:
            raise InvalidRequest("'input' is a required property (or 'messages').",
                                 param="input", code="invalid_value")


PoolingRequest = RerankRequest | ScoreRequest | ClassifyRequest
