"""What a stream's read timeout costs per chunk: aiohttp's re-armed timer against one watch.

The gateway bounds an engine's silence (`upstream.read_timeout_s`). aiohttp's `sock_read` does it
by re-arming a timer on every read of the connection; `gateway/silence.py` keeps one timer per
stream and the relay's two stores a read. This runs the relay's read loop, as
`Forwarder._stream` writes it (a copy: the gateway's has no seam to time alone), over the stub
engine (benchmarks/stub_engine.py, its own process and CPU) in three modes, rounds interleaved,
and prints the client process's CPU per chunk (user + system, `time.process_time`), medians
over rounds:

- `aiohttp`: `sock_read` on, read with `readany` (the relay before);
- `watch`: `sock_read` on for the headers, the body under `SilenceWatch` (the relay now);
- `none`: no read timeout at all (the floor: what a timer costs is `aiohttp` or `watch` less it).

    python benchmarks/read_timer.py --streams 300 --tokens 400 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.silence import NOT_WAITING, SilenceWatch  # noqa: E402

MODES = ("aiohttp", "watch", "none")


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, mode: str,
                     limits: aiohttp.ClientTimeout) -> int:
    loop = asyncio.get_running_loop()
    loop_time = loop.time
    chunks = 0
    async with session.post(url, data=body, timeout=limits,
                            headers={"content-type": "application/json"}) as resp:
        content = resp.content
        if mode == "watch":
            watch = SilenceWatch(loop, resp, 600.0)
            try:
                while True:
                    watch.since = loop_time()
                    chunk = await content.readany()
                    watch.since = NOT_WAITING
                    if not chunk:
                        break
                    chunks += 1
            finally:
                watch.close()
        else:
            while await content.readany():
                chunks += 1
    return chunks


async def window(session: aiohttp.ClientSession, url: str, body: bytes, mode: str,
                 streams: int) -> tuple[float, int]:
    read = 600.0 if mode != "none" else None
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=5, sock_read=read)
    cpu = time.process_time()
    counts = await asyncio.gather(*(one_stream(session, url, body, mode, timeout)
                                    for _ in range(streams)))
    return time.process_time() - cpu, sum(counts)


async def run(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    body = (b'{"model":"bench-model","messages":[{"role":"user","content":"x"}],'
            b'"stream":true,"max_tokens":%d,"stub_ttft_ms":1,"stub_itl_ms":%g}'
            % (args.tokens, args.itl_ms))
    per_chunk: dict[str, list[float]] = {m: [] for m in MODES}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await window(session, url, body, "none", args.streams)  # connections opened, warm
        for r in range(args.rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                cpu_s, chunks = await window(session, url, body, mode, args.streams)
                per_chunk[mode].append(cpu_s / max(chunks, 1) * 1e6)
    return per_chunk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=400, help="tokens (reads) per stream")
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--port", type=int, default=8197)
    args = ap.parse_args()
    pin = (os.cpu_count() or 1) >= 2 and shutil.which("taskset")
    argv = [sys.executable, str(ROOT / "benchmarks/stub_engine.py"), "--port", str(args.port)]
    engine = subprocess.Popen(["taskset", "-c", "0", *argv] if pin else argv,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if pin:
        os.sched_setaffinity(0, {1})
    try:
        time.sleep(1.0)
        url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
        per_chunk = uvloop.run(run(args, url))
    finally:
        engine.terminate()
        engine.wait(5)
    print(f"{args.streams} streams x {args.tokens} reads at {args.itl_ms:g} ms, "
          f"{args.rounds} rounds interleaved; client CPU per chunk (us), medians [range]:")
    med = {m: statistics.median(v) for m, v in per_chunk.items()}
    for m in MODES:
        print(f"  {m:8} {med[m]:6.2f}  [{min(per_chunk[m]):.2f} .. {max(per_chunk[m]):.2f}]")
    print(f"  the timer's cost over none: aiohttp +{med['aiohttp'] - med['none']:.2f} us, "
          f"watch +{med['watch'] - med['none']:.2f} us; watch / aiohttp "
          f"{med['watch'] / med['aiohttp']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
