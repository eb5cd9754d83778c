"""Stand-ins for engines we do not own, on aiohttp in a thread of their own.

Most tests run the simulated engine as a real process (tests/servers.py); these are for the
answers no engine of ours gives (a key it demands, a vLLM error shape, a transport cut). A
subclass answers `chat`; `/health` says ok unless it overrides `health`. `running(engine)`
serves it on its own event loop in a thread while the test blocks on the SDK.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

import anyio.from_thread
from aiohttp import web

from tests.servers import free_port

# The completion every plain stand-in answers, usage included.
CHAT_OK: dict[str, Any] = {
    "id": "x", "object": "chat.completion", "created": 1, "model": "test-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 17, "completion_tokens": 1, "total_tokens": 18}}


class StandIn:
    """An engine stand-in on loopback: POST /v1/chat/completions and GET /health."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def chat(self, req: web.Request) -> web.StreamResponse:
        return web.json_response(CHAT_OK)

    async def health(self, req: web.Request) -> web.Response:
        return web.Response(text="ok")

    def more_routes(self) -> list[web.RouteDef]:
        """Routes a subclass answers beyond chat and health."""
        return []

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self.chat),
                        web.get("/health", self.health), *self.more_routes()])
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


E = TypeVar("E", bound=StandIn)


@contextlib.contextmanager
def running(engine: E) -> Iterator[E]:
    """Serve `engine` until the block ends (a fixture yields from inside it)."""
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        runner = portal.call(engine.start)
        try:
            yield engine
        finally:
            portal.call(runner.cleanup)
