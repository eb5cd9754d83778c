"""A chat body is checked by hand (gateway/wire/openai.py `_chat_request`) and read as a
`ChatRequest`; `ChatCompletionRequest`, the pydantic model, states the same rules and words
the errors. Hypothesis draws bodies near those rules, valid or not, and holds the two to one
verdict: the hand check accepts exactly what the model accepts, and reads the same fields.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.errors import InvalidRequest
from gateway.wire.openai import (
    ChatCompletionRequest,
    ChatRequest,
    _chat_of,
    _chat_request,
    parse_request,
)

# Values JSON can carry, the odd ones included: bools where ints go, floats, huge ints.
_EDGES = st.sampled_from([-1, 0, 1, 128, 129, 16.0, True, False, None, "1", "user", ""])
_SCALARS = st.one_of(_EDGES, _EDGES, st.integers(-3, 300),
                     st.integers(2**62, 2**64 - 1), st.floats(allow_nan=False),
                     st.sampled_from(["", "user", "16", "true"]))
_ANY = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["a", "role", "content"]), inner,
                                      max_size=3), max_leaves=6)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                           "content": st.one_of(st.text(max_size=5), st.none(), _ANY)}),
    st.fixed_dictionaries({"role": _SCALARS}),
    st.fixed_dictionaries({}, optional={"content": st.text(max_size=3)}),
    _SCALARS,
)
_OPTIONS = st.one_of(st.fixed_dictionaries({"include_usage": _SCALARS},
                                           optional={"other": _SCALARS}), _SCALARS)
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("m"), _SCALARS),
    "messages": st.one_of(st.lists(_MESSAGE, max_size=3), _SCALARS, st.just([])),
    "stream": _SCALARS,
    "stream_options": _OPTIONS,
    "max_tokens": _SCALARS,
    "max_completion_tokens": _SCALARS,
    "n": st.one_of(_SCALARS, st.sampled_from([0, 1, 128, 129])),
    "tools": st.one_of(_SCALARS, st.lists(_ANY, max_size=2)),
    "temperature": _SCALARS,
}
# Values each field takes in a valid body, where they are not the drawn ones above.
_VALID: dict[str, st.SearchStrategy[Any]] = {
    "stream": st.one_of(st.booleans(), st.none()),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {}, optional={"include_usage": st.one_of(st.booleans(), st.none())})),
    "max_tokens": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "max_completion_tokens": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "n": st.one_of(st.none(), st.integers(1, 128)),
    "tools": st.one_of(st.none(), st.lists(_ANY, max_size=2)),
    "temperature": _SCALARS,
}


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with at most one field drawn from anything (or left out)."""
    body = draw(st.fixed_dictionaries(
        {"model": st.just("m"),
         "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                     "content": st.text(max_size=3)}),
                              min_size=1, max_size=2)}, optional=_VALID))
    odd = draw(st.none() | st.sampled_from(sorted(_FIELDS)))
    if odd is not None:
        if draw(st.booleans()):
            body.pop(odd, None)
        else:
            body[odd] = draw(_FIELDS[odd])
    return body


_BODY = _bodies() | st.fixed_dictionaries({}, optional=_FIELDS)


@settings(max_examples=1500, deadline=None)
@given(_BODY)
def test_hand_check_agrees_with_the_model(body: dict[str, Any]) -> None:
    data = orjson.loads(orjson.dumps(body))  # as the gateway gets it: orjson's own types
    fast = _chat_request(data)
    try:
        model = ChatCompletionRequest.model_validate(data)
    except ValidationError:
        event("refused")
        assert fast is None, f"accepted by hand, refused by the model: {data}"
        return
    event("accepted")
    assert fast == _chat_of(model), data


def test_a_valid_body_never_reaches_pydantic(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("validated by the model")

    monkeypatch.setattr(ChatCompletionRequest, "model_validate", refuse)
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 16, "n": 2, "messages": [{"role": "user", "content": "hi"}]}
    data, parsed = parse_request(orjson.dumps(body), "chat")
    assert parsed == ChatRequest("m", True, True, 16, None, 2, None)
    assert parsed.output_limit == 16
    assert data == body


def test_a_refused_body_keeps_the_models_words() -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request(orjson.dumps({"model": "m", "messages": [{"role": 1}]}), "chat")
    assert err.value.param == "messages[0].role"
    assert "Input should be a valid string" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        parse_request(orjson.dumps({"messages": [{"role": "user"}]}), "chat")
    assert err.value.message == "'model' is a required property"
