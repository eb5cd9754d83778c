"""Every way the gateway can say no, or fail, in one tree.

Routing, admission, quotas and the parsers raise these as domain facts: what was refused,
which limit refused it (`reason`), how long waiting would take (`retry_after_s`). They know
nothing of HTTP. The API boundary (gateway/api/errors.py) maps each class to its status code
and renders OpenAI's error body `{"error": {"message", "type", "param", "code"}}`, with the
`type` of OpenAI's vocabulary for that status, so that the official SDKs raise the matching
exception (`BadRequestError`, `RateLimitError`, ...) and a caller matching on `type` meets
one vocabulary whoever refused (the proxy maps the engines' errors to it too); `code` is a
string or null (docs/errors.md lists every status, type and code):

    GatewayError                                anything the gateway answers with an error
      +-- Refusal                               the request is not taken; no engine has seen it
      |     +-- InvalidRequest        400 invalid_request_error  bad JSON, schema, JSON shape,
      |     |                                   context length
      |     +-- Unauthorized          401 authentication_error   no key, or an unknown one
      |     +-- Forbidden             403 permission_error       the tenant may not use this model
      |     +-- ModelNotFound         404 not_found_error        no such model in the policy
      |     +-- RequestTimeout        408 invalid_request_error  the body trickled in too slowly
      |     +-- BodyTooLarge          413 invalid_request_error  over `server.max_body_bytes`
      |     +-- UnsupportedMediaType  415 invalid_request_error  a compressed body
      |     +-- QuotaExceeded         429 rate_limit_error       the tenant's token bucket is
      |     |                                   empty (`window`)
      |     +-- Overloaded            503 server_error           a pool is at capacity (`reason`
      |           |                             names the limit)
      |           +-- NoBackendAvailable        no healthy backend in the pool
      |           +-- StateUnavailable          the shared state is down and the pool fails closed
      +-- Failure                               something broke on the way
            +-- UpstreamError         502 server_error           every backend refused the
            |     |                             connection, a 5xx, an answer not relayed
            |     +-- UpstreamTimeout 504 server_error   the engine took the request and
            |                                   was silent past `read_timeout_s`
            +-- InternalError         500 server_error           a bug: logged with its
                                                traceback, never shown

`retry_after_s` is set on every 429 and 503, in seconds (a float: a bucket's refill is known
to the millisecond); the boundary sends it as Retry-After (whole seconds) and retry-after-ms,
with x-should-retry saying whether an SDK's automatic retry can help (false past the wait an
SDK will sleep).

Errors of the cost stage (gateway/cost/errors.py) stay inside that package; the pipeline turns
the caller's ones into `InvalidRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RateWindow:
    """The state of the tightest token bucket a request met: what x-ratelimit-* report."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    retry_s: float  # until it holds what was asked (0: it does now)


class GatewayError(Exception):
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after_s = retry_after_s
        self.reason = reason  # which limit or check refused it, for x-gateway-reason


class Refusal(GatewayError):
    """The gateway declines the request before any engine sees it."""


class InvalidRequest(Refusal):
    pass


class Unauthorized(Refusal):
    code = "invalid_api_key"


class Forbidden(Refusal):
    code = "model_not_allowed"


class ModelNotFound(Refusal):
    code = "model_not_found"


class RequestTimeout(Refusal):
    code = "request_timeout"


class BodyTooLarge(Refusal):
    code = "request_too_large"


class UnsupportedMediaType(Refusal):
    code = "unsupported_content_encoding"


class QuotaExceeded(Refusal):
    code = "rate_limit_exceeded"

    def __init__(self, message: str, window: RateWindow) -> None:
        super().__init__(message, retry_after_s=max(1.0, window.retry_s))
        self.window = window


class Overloaded(Refusal):
    code = "overloaded"


class ServerBusy(Overloaded):
    code = "server_busy"


class NoBackendAvailable(Overloaded):
    code = "no_healthy_backend"


class StateUnavailable(Overloaded):
    code = "state_unavailable"


class Failure(GatewayError):
    """Something broke on the way to or from an engine, or in the gateway itself."""


class UpstreamError(Failure):
    code = "upstream_error"

    def __init__(self, message: str, *, backend: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend  # the backend's policy name, never its URL


class UpstreamTimeout(UpstreamError):
    """The engine took the request and did not answer in time: it may still be working on it,
    so no other backend is given it."""

    code = "upstream_timeout"


class InternalError(Failure):
    code = None
