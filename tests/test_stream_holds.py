"""What an open stream keeps alive in the gateway: for its whole life (seconds to minutes)
every full collection walks it and its memory stays taken, so the request's prompt (its
parsed body, messages, token hashes, the bytes sent upstream) must not be among it.

The gateway runs in this process (the real app, served by uvicorn with the gateway's own
protocol on a loopback socket, against the simulated engine in its own process) so that the
test can look at its heap while the official SDK holds a stream open.
"""

from __future__ import annotations

import gc

import anyio
import openai
import pytest
import uvicorn

from gateway.app import GatewayApp
from gateway.pipeline.prepared import Prepared
from gateway.policy.loader import parse_policy
from gateway.serving.server import ConnectionLimits, server_config
from gateway.upstream.forward import Upstream
from tests.conftest import StartSim, policy_yaml
from tests.servers import free_port

# The keeper off: it would freeze and set thresholds in the test's own process.
NO_KEEPER = "server:\n  gc_freeze_interval_s: 0\n"


def _alive(kind: type) -> list[object]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, kind)]


@pytest.mark.anyio
@pytest.mark.parametrize("words", [5, 600], ids=["short", "long"])
async def test_an_open_stream_holds_neither_its_prompt_nor_its_body(start_sim: StartSim,
                                                                    words: int) -> None:
    # 600 words are counted in a worker thread, whose result must not keep the request
    # either.
    content = " ".join(f"word{i}" for i in range(words))
    with start_sim() as sim:
        app = GatewayApp(parse_policy(policy_yaml([sim.url], extra=NO_KEEPER)))
        port = free_port()
        server = uvicorn.Server(server_config(app, "127.0.0.1", port, None,
                                              ConnectionLimits()))
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                                    max_retries=0)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.serve)
                for _ in range(1500):  # 30 s at most: its lifespan loads the tokenizer
                    if server.started:
                        break
                    await anyio.sleep(0.02)
                assert server.started
                stream = await client.chat.completions.create(
                    model="test-model", messages=[{"role": "user", "content": content}],
                    max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    break  # the answer has started; the stream stays open
                await anyio.sleep(0.2)  # a count behind lands
                assert _alive(Prepared) == []
                upstreams = _alive(Upstream)
                assert len(upstreams) == 1
                assert upstreams[0].body == b""  # the engine has it
                await stream.close()
                server.should_exit = True
        finally:
            await client.close()
            gc.unfreeze()  # the app's start-up froze this process's heap
