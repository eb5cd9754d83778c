"""aiohttp behind the seam: requests to the engines the gateway's own client does not serve
(https, credentials in the URL), and the whole answers of the pass-through endpoints.

aiohttp's exceptions are mapped to the gateway's own (gateway/upstream/errors.py) here and
nowhere else, on the request and on every read of a body. aiohttp's per-read timeout
(`sock_read`) watches the engine's silence on this path, body included.
"""

from __future__ import annotations

import errno
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from gateway.upstream.errors import (
    BrokeOff,
    ClosedBeforeAnswer,
    ConnectTimeout,
    CutBody,
    EngineFailure,
    Malformed,
    Silent,
    Unreachable,
    describe,
)


def _failure(exc: BaseException, answered: bool) -> EngineFailure:
    """aiohttp's exception (or a timeout) as the gateway's; `answered`: the head was in."""
    detail = describe(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        failure: EngineFailure = ConnectTimeout(detail)
    elif isinstance(exc, aiohttp.ClientConnectorError):
        failure = Unreachable(detail)
    elif isinstance(exc, aiohttp.ServerDisconnectedError):
        failure = CutBody(detail) if answered else ClosedBeforeAnswer(detail)
    elif isinstance(exc, TimeoutError):
        failure = Silent(detail)
    elif isinstance(exc, aiohttp.ClientPayloadError):
        failure = CutBody(detail)
    elif isinstance(exc, aiohttp.ClientResponseError):  # an answer aiohttp could not parse
        failure = Malformed(detail)
    elif isinstance(exc, aiohttp.ClientOSError) and exc.errno == errno.ECONNRESET:
        failure = BrokeOff(detail, "the engine reset the connection")
    else:
        failure = BrokeOff(detail)
    forget(exc)
    return failure


def forget(exc: BaseException | None) -> None:
    """Break the reference cycles aiohttp's exception closes, so its reference count frees it:
    aiohttp keeps the cause in a local of a frame its traceback holds, a cycle that only a
    full collection would free, minutes away. For every place the gateway catches one (the
    forwarder's requests here, the backends' probes, the engines' scrapes)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


class AioAnswer:
    """An aiohttp ClientResponse as the seam's `Answer`."""

    __slots__ = ("_resp",)

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp

    @property
    def status(self) -> int:
        return self._resp.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._resp.headers

    async def readany(self) -> bytes:
        try:
            return await self._resp.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = _failure(exc, answered=True)
        raise failure  # outside the handler: nothing of aiohttp's kept as its context

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = _failure(exc, answered=True)
        finally:
            self._resp.release()
        raise failure

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()

    def stop_read_timeout(self) -> bool:
        return False  # sock_read goes on watching each read

    def fail(self, exc: EngineFailure) -> None:
        self._resp.content.set_exception(exc)


@dataclass(frozen=True, slots=True)
class Whole:
    """An answer read whole."""

    status: int
    body: bytes
    headers: Mapping[str, str]


class AioClient:
    """aiohttp's session behind the seam. The session is the gateway's one (no cookies kept,
    no redirects followed, no decompression: runtime.make_session)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._timeouts: dict[tuple[float, float], aiohttp.ClientTimeout] = {}

    def _timeout(self, connect_s: float, read_s: float) -> aiohttp.ClientTimeout:
        key = (connect_s, read_s)
        timeout = self._timeouts.get(key)
        if timeout is None:
            timeout = self._timeouts[key] = aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=connect_s, sock_read=read_s)
        return timeout

    async def post(self, url: str, request_id: str, body: bytes, auth_header: str | None,
                   connect_timeout_s: float, read_timeout_s: float) -> AioAnswer:
        headers = {"content-type": "application/json", "x-request-id": request_id,
                   "accept-encoding": "identity"}
        if auth_header:
            headers["authorization"] = auth_header
        try:
            resp = await self.session.post(url, data=body, headers=headers,
                                           timeout=self._timeout(connect_timeout_s,
                                                                 read_timeout_s),
                                           allow_redirects=False)
            return AioAnswer(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = _failure(exc, answered=False)
        raise failure

    async def probe(self, url: str, auth_header: str | None, timeout_s: float
                    ) -> tuple[bool, str]:
        """A health probe (gateway/routing/backends.py): up when `url` answers 200 within
        `timeout_s`. A redirect is not followed, as requests' are not: the backend is down until
        its url is where the engine answers."""
        headers = {"authorization": auth_header} if auth_header else None
        try:
            async with self.session.get(url, headers=headers, allow_redirects=False,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                detail = f"HTTP {resp.status}"
                if 300 <= resp.status < 400:
                    detail += " (a redirect, not followed)"
                return resp.status == 200, detail
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail = type(exc).__name__
            forget(exc)  # a down backend's every probe would leave a cycle for the sweep
            return False, detail

    async def get_text(self, url: str, timeout_s: float) -> str | None:
        """An engine's page (its /metrics, llama.cpp's /props): its text if it answers 200
        within `timeout_s`, else None. A redirect is not followed, as requests' are not."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                        allow_redirects=False) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            forget(exc)  # a down engine's every scrape would leave a cycle for the sweep
            return None

    async def request(self, method: str, url: str, body: bytes | None,
                      headers: dict[str, str], connect_timeout_s: float,
                      read_timeout_s: float) -> Whole:
        """One call answered whole (the pass-through endpoints: nothing streamed)."""
        try:
            async with self.session.request(
                    method, url, data=body, headers=headers, allow_redirects=False,
                    timeout=self._timeout(connect_timeout_s, read_timeout_s)) as resp:
                return Whole(resp.status, await resp.read(), resp.headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = _failure(exc, answered=False)
        raise failure
