"""The boundary where the gateway's errors (gateway/errors.py) become HTTP answers.

One table says which status and OpenAI error `type` each class of the tree answers with; one
function renders the headers a client acts on (Retry-After, x-gateway-reason, x-ratelimit-*,
x-gateway-backend) from the facts the error carries.
"""

from __future__ import annotations

import math
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
)
from gateway.protocol import error_body, rate_limit_headers

# Most specific first is not needed: the class's own entry, else its nearest ancestor's.
_STATUS: dict[type[GatewayError], tuple[int, str]] = {
    InvalidRequest: (400, "invalid_request_error"),
    Unauthorized: (401, "invalid_request_error"),
    Forbidden: (403, "invalid_request_error"),
    ModelNotFound: (404, "invalid_request_error"),
    RequestTimeout: (408, "invalid_request_error"),
    BodyTooLarge: (413, "invalid_request_error"),
    UnsupportedMediaType: (415, "invalid_request_error"),
    QuotaExceeded: (429, "tokens"),
    Overloaded: (503, "service_unavailable"),
    UpstreamError: (502, "upstream_error"),
    Failure: (500, "server_error"),
    GatewayError: (500, "server_error"),
}


def status_of(err: GatewayError) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of an error of the tree."""
    for cls in type(err).__mro__:
        hit = _STATUS.get(cls)
        if hit is not None:
            return hit
    return 500, "server_error"


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
    if err.retry_after_s is not None:
        out.append((b"retry-after", b"%d" % max(1, math.ceil(err.retry_after_s))))
    if err.reason is not None:
        out.append((b"x-gateway-reason", err.reason.encode()))
    if isinstance(err, QuotaExceeded):
        out.extend(rate_limit_headers(err.window))
    if isinstance(err, UpstreamError) and err.backend is not None:
        out.append((b"x-gateway-backend", err.backend.encode()))
    return out
