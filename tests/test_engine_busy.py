"""An engine's own 503 (vLLM's queue valves, `--max-num-queued-reqs` / `--max-num-queued-tokens`:
"so that load balancers and client SDKs retry the request on a different instance",
vllm/exceptions.py): the request did not start there, so the gateway gives it to another
backend of the pool; where every one is busy, the caller gets the last 503 with the gateway's
retry headers. Nothing stays reserved. tests/test_vllm.py holds it against vLLM's own valve.
"""

from __future__ import annotations

import json

from aiohttp import web

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import http, quiet
from tests.stand_ins import StandIn, running

BUSY = {"error": {"message": "The engine is currently busy and cannot accept new requests. "
                             "Please try again later or on a different instance.",
                  "type": "ServiceUnavailableError", "param": None, "code": 503}}


class Busy(StandIn):
    """vLLM with its queue full: every request refused with 503 before it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = 0

    async def chat(self, req: web.Request) -> web.StreamResponse:
        self.hits += 1
        return web.Response(status=503, content_type="application/json",
                            body=json.dumps(BUSY).encode())


def _chat(url: str, stream: bool = False) -> tuple[int, dict[str, str], bytes]:
    reply = http("POST", url + "/v1/chat/completions",
                 {"model": "test-model", "max_tokens": 4, "stream": stream,
                  "messages": [{"role": "user", "content": "Hello"}]})
    return reply.status, reply.headers, reply.body


def test_a_busy_engines_503_goes_to_another_backend(start_sim: StartSim,
                                                    start_gateway: StartGateway) -> None:
    with running(Busy()) as busy, start_sim() as sim, \
            start_gateway(policy_yaml([busy.url, sim.url])) as gw:
        answers = [_chat(gw.url, stream=i % 2 == 1) for i in range(8)]
        assert [a[0] for a in answers] == [200] * 8
        assert {a[1]["x-gateway-backend"] for a in answers} == {"e1"}
        assert busy.hits >= 1  # some were placed there first, and moved on
        quiet(gw.url)


def test_every_backend_busy_is_a_503_with_retry_headers(start_gateway: StartGateway) -> None:
    with running(Busy()) as a, running(Busy()) as b, \
            start_gateway(policy_yaml([a.url, b.url])) as gw:
        status, headers, body = _chat(gw.url)
        assert status == 503 and (a.hits, b.hits) == (1, 1)
        assert (headers["retry-after"], headers["retry-after-ms"],
                headers["x-should-retry"]) == ("1", "1000", "true")
        assert headers["x-gateway-backend"] in ("e0", "e1")
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and error["message"] == BUSY["error"]["message"]
        quiet(gw.url)
