"""The forwarder's two HTTP clients side by side: aiohttp's and the gateway's (gateway/http1.py).

Both post the same chat request, as the forwarder sends it, to the stub engine over a kept-alive
connection, alternating, back to back ("hot") and after `--gap-ms` of the CPU idle ("cold", as
between requests at 10 streams). Two figures each, medians:

- to the socket: from the call to the request's bytes handed to the transport (aiohttp's
  `StreamWriter` and the gateway's `Connection.send`, which writes at once, are wrapped to note
  the time), which is what the client adds before the engine can start;
- to the engine: from the call to the engine's own clock reading when the request arrived (the
  stub is started with `--stamp`, and writes it into its first frame), which adds the kernel's
  loopback and the engine's wake-up, the same for both;
- CPU: the calling thread's CPU time from the call to the answer's headers.

Run: python benchmarks/engine_client.py [--rounds 60] [--gap-ms 35] [--cpu 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.http_writer
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway import http1  # noqa: E402
from gateway.http1 import EnginePool, target_of  # noqa: E402
from loadtest.stats import median  # noqa: E402
from tests.servers import free_port  # noqa: E402

BODY = (b'{"model":"bench-model","max_tokens":2,"stream":true,"stub_ttft_ms":0,"stub_itl_ms":0,'
        b'"messages":[{"role":"user","content":"Say hello."}]}')
_WRITES: list[int] = []


def _note_writes() -> None:
    """Both clients' writers, noting when each request's bytes go to the transport."""
    for owner, name in ((aiohttp.http_writer.StreamWriter, "_write"),
                        (aiohttp.http_writer.StreamWriter, "_writelines"),
                        (http1.Connection, "send")):
        orig = getattr(owner, name)

        def noted(self: object, *args: object, _orig: Callable[..., Any] = orig) -> Any:
            _WRITES.append(time.monotonic_ns())
            return _orig(self, *args)
        setattr(owner, name, noted)


def _arrived(body: bytes) -> int:
    i = body.index(b'"stamp-') + 7
    return int(body[i:body.index(b'"', i)])


async def main(args: argparse.Namespace) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    if args.cpu is not None:  # the engine on the other CPU(s), this client on its own
        others = (os.sched_getaffinity(0) - {args.cpu}) or {args.cpu}
        os.sched_setaffinity(0, others)
    engine = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "benchmarks" / "stub_engine.py"), "--port", str(port),
        "--stamp", stdout=asyncio.subprocess.DEVNULL)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=100, limit_per_host=0, keepalive_timeout=4),
        auto_decompress=False, skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar())
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=3, sock_read=600)
    headers = {"content-type": "application/json", "x-request-id": "bench",
               "accept-encoding": "identity"}
    pool = EnginePool(100, 4.0)
    target = target_of(url, None)
    assert target is not None
    _note_writes()

    async def aio() -> tuple[int, bytes]:
        resp = await session.post(url, data=BODY, headers=headers, timeout=timeout,
                                  allow_redirects=False)
        took = time.thread_time_ns()
        async with resp:
            return took, await resp.read()

    async def native() -> tuple[int, bytes]:
        resp = await pool.post(target, "bench", BODY, 3.0, 600.0)
        took = time.thread_time_ns()
        async with resp:
            return took, await resp.read()

    clients: dict[str, Callable[[], Awaitable[tuple[int, bytes]]]] = {
        "aiohttp": aio, "gateway (http1)": native}
    figures: dict[tuple[str, bool], list[tuple[float, float, float]]] = {}
    try:
        for _ in range(100):  # the engine up
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.05)
        for i in range(args.rounds + 5):
            for name, call in clients.items():
                for cold in (False, True):
                    if cold:
                        await asyncio.sleep(args.gap_ms / 1e3)
                    _WRITES.clear()
                    start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
                    cpu1, body = await call()
                    if i >= 5:  # the first rounds warm both up
                        figures.setdefault((name, cold), []).append(
                            ((_WRITES[0] - start) / 1e3, (_arrived(body) - start) / 1e3,
                             (cpu1 - cpu0) / 1e3))
    finally:
        await session.close()
        await pool.close()
        engine.terminate()
        await engine.wait()
    print(f"{args.rounds} rounds, each client hot and after {args.gap_ms:g} ms idle; medians, us")
    print("| client | to the socket, hot / cold | to the engine, hot / cold | "
          "CPU to headers, hot / cold |")
    print("|---|---|---|---|")
    for name in clients:
        hot, cold = figures[(name, False)], figures[(name, True)]
        cells = [f"{median([f[k] for f in hot]):.0f} / {median([f[k] for f in cold]):.0f}"
                 for k in range(3)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--gap-ms", type=float, default=35.0)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    uvloop.run(main(p.parse_args()))
