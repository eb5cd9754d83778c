"""The calls that carry no generation, passed to the engine that can answer them.

- `GET /v1/models/{id}`: the model, from the policy.
- `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: to the backend that stored the
  response (gateway/routing/affinity.py); 404 when the gateway does not know it.
- `POST /tokenize`, `POST /detokenize`: to a healthy backend of the model's pool.
- `POST /pooling`: vLLM's generic pooling endpoint, likewise. Not admitted as the other
  pooling endpoints are (gateway/wire/pooling.py): what it costs depends on its `task` and, for
  IO-processor plugins, on `data` of the plugin's own shape, which no tokenizer counts.

Nothing here is admitted or metered (no KV is held, no token generated), but the caller is
identified exactly as for a completion (401/403 alike) and the body bounded the same way.
"""

from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.errors import http_error
from gateway.api.openai import new_request_id
from gateway.errors import (
    BodyTooLarge,
    GatewayError,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    NoBackendAvailable,
)
from gateway.routing.backends import Backend
from gateway.runtime import Runtime, runtime_of
from gateway.wire.openai import check_shape

log = logging.getLogger("gateway.api")


def routes() -> list[Route]:
    return [Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", tokenize, methods=["POST"]),
            Route("/pooling", tokenize, methods=["POST"])]


def _runtime(request: Request) -> Runtime:
    rt = runtime_of(request)
    assert rt is not None, "lifespan has not run"
    return rt


def _error(err: GatewayError) -> Response:
    answer = http_error(err)
    return Response(answer.body, status_code=answer.status, media_type="application/json",
                    headers={k.decode(): v.decode() for k, v in answer.headers})


async def model(request: Request) -> Response:
    rt = _runtime(request)
    if not request.path_params["model_id"]:
        raise HTTPException(404)  # `/v1/models/`: an unknown path, answered as every other
    try:
        rt.tenants.identify(request.headers.get("authorization", "").encode("latin-1") or None)
        spec = rt.router.model(request.path_params["model_id"])
    except GatewayError as err:
        return _error(err)
    return Response(orjson.dumps({"id": spec.name, "object": "model",
                                  "created": int(rt.started_at), "owned_by": "gateway"}),
                    media_type="application/json")


async def retrieve(request: Request) -> Response:
    return await _stored(request, "GET", "")


async def cancel(request: Request) -> Response:
    return await _stored(request, "POST", "/cancel")


async def _stored(request: Request, method: str, suffix: str) -> Response:
    rt = _runtime(request)
    response_id = request.path_params["response_id"]
    try:
        rt.tenants.identify(request.headers.get("authorization", "").encode("latin-1") or None)
        held = await rt.affinity.recall(response_id)
        if held is None:
            raise ModelNotFound(f"No response with id `{response_id}` is known here (stored "
                                "responses are remembered for upstream.responses_ttl_s).",
                                param="response_id", code="response_not_found")
        backend = next((b for b in rt.backends.pools.get(held.pool, [])
                        if b.name == held.backend), None)
        if backend is None or not backend.available(rt.backends.clock()):
            raise NoBackendAvailable(f"The backend that stored response `{response_id}` is not "
                                     "available.", retry_after_s=1)
        url = f"{backend.url}/v1/responses/{response_id}{suffix}"
        return await _forward(rt, backend_url=url, backend=backend, method=method, body=None)
    except GatewayError as err:
        return _error(err)


# Passed to a backend of the model's pool: the path -> the engine endpoint (backends.py).
_MODEL_ROUTED = {"/tokenize": "tokenize", "/detokenize": "detokenize", "/pooling": "pooling"}


async def tokenize(request: Request) -> Response:
    rt = _runtime(request)
    endpoint = _MODEL_ROUTED[request.url.path]
    try:
        tenant = rt.tenants.identify(
            request.headers.get("authorization", "").encode("latin-1") or None)
        server = rt.policy.server
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > server.max_body_bytes:
            raise BodyTooLarge(f"The request body is {declared} bytes; the limit is "
                               f"{server.max_body_bytes} bytes.")
        body = await request.body()
        if len(body) > server.max_body_bytes:
            raise BodyTooLarge(f"The request body exceeds the limit of "
                               f"{server.max_body_bytes} bytes.")
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"The request body is not valid JSON: {exc}",
                                 code="invalid_json") from None
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            raise InvalidRequest("'model' is a required property", param="model",
                                 code="invalid_value")
        check_shape(data, server.max_json_depth, server.max_json_items)
        spec = rt.router.model(data["model"])
        rt.tenants.check_model(tenant, spec.name)
        pool = rt.router.route(spec).pool
        backend = rt.router.pick(pool)
        if backend is None:
            raise NoBackendAvailable(f"No healthy backend in pool `{pool}`.", retry_after_s=1)
        data["model"] = spec.upstream_name
        return await _forward(rt, backend_url=backend.urls[endpoint], backend=backend,
                              method="POST", body=orjson.dumps(data))
    except GatewayError as err:
        return _error(err)


async def _forward(rt: Runtime, *, backend_url: str, backend: Backend, method: str,
                   body: bytes | None) -> Response:
    request_id = new_request_id()
    try:
        status, answer, content_type = await rt.forwarder.passthrough(
            backend, method, backend_url, body, request_id)
    except GatewayError:
        raise
    except Exception:
        log.exception("unexpected error in request %s", request_id)
        raise InternalError(f"Internal gateway error (request id {request_id}).") from None
    return Response(answer, status_code=status, media_type=content_type,
                    headers={"x-request-id": request_id, "x-gateway-backend": backend.name})
