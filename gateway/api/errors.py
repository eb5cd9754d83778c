"""The boundary where the gateway's errors (gateway/errors.py) become HTTP answers.

One table says which status each class of the tree answers with, and so its OpenAI error
`type` (gateway/wire/openai.py `error_type`: the same vocabulary the proxy gives the engines'
errors); one function renders the headers a client acts on (Retry-After, retry-after-ms,
x-should-retry, x-gateway-reason, x-ratelimit-*, x-gateway-backend) from the facts the error
carries. docs/errors.md lists every status, type and code.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import (
    BodyTooLarge,
    Failure,
    Forbidden,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    QuotaExceeded,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.wire.openai import error_body, error_type, rate_limit_headers, retry_headers

# Most specific first is not needed: the class's own entry, else its nearest ancestor's.
_STATUS: dict[type[GatewayError], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    ModelNotFound: 404,
    RequestTimeout: 408,
    BodyTooLarge: 413,
    UnsupportedMediaType: 415,
    QuotaExceeded: 429,
    Overloaded: 503,
    UpstreamTimeout: 504,
    UpstreamError: 502,
    Failure: 500,
    GatewayError: 500,
}


def status_of(err: GatewayError) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of an error of the tree."""
    for cls in type(err).__mro__:
        status = _STATUS.get(cls)
        if status is not None:
            return status, error_type(status)
    return 500, error_type(500)


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)


def http_error(err: GatewayError) -> HttpError:
    status, type_ = status_of(err)
    return HttpError(status, headers_of(err), error_body(err.message, type_, err.param, err.code))


def headers_of(err: GatewayError) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    if err.retry_after_s is not None:  # every 429 and 503 of the tree
        out.extend(retry_headers(err.retry_after_s))
    if err.reason is not None:
        out.append((b"x-gateway-reason", err.reason.encode()))
    if isinstance(err, QuotaExceeded):
        out.extend(rate_limit_headers(err.window))
    if isinstance(err, UpstreamError) and err.backend is not None:
        out.append((b"x-gateway-backend", err.backend.encode()))
    return out
