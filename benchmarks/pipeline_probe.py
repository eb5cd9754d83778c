"""The gateway's own work before a request goes upstream, timed in-process, hot and cold.

Runs the pipeline's stages as `Pipeline.serve` does up to the forward (identify, read, parse,
count, route, estimate, quota, the upstream body, admission), then releases the reservation,
over a runtime built from the proxy benchmark's policy (the floor, or as shipped) and an engine
that answers its probe. No socket and no other process is in the timed part, so its figures
are the gateway's code alone:

- hot: back to back, as a loaded gateway runs it;
- cold: each request after `gap_s` of the CPU idle, as at 10 streams, where the machine's
  cache loss (benchmarks/proxy_overhead.py's cold probe) multiplies every stage.

`python benchmarks/pipeline_probe.py --engine http://127.0.0.1:PORT` prints both; the proxy
benchmark prints them beside its cold probe.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics
from gateway.pipeline import Pipeline, RequestContext
from gateway.pipeline.eager import finish
from gateway.pipeline.forward import upstream_body
from gateway.pipeline.inbound import Inbound
from gateway.pipeline.prepare import prepare
from gateway.policy.loader import parse_policy
from gateway.runtime import build_runtime, load_counters, make_session
from gateway.state.memory import MemoryState
from gateway.upstream.forward import STAGE_CLOCK, Send

_HEADERS = {b"content-type": b"application/json"}


class _Caller:
    """The pipeline's `Client` with the body in hand: nothing of a transport is timed."""

    gone = False

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.send: Send = _discard  # where the forwarder would write the answer

    async def read_body(self, limit: int, timeout_s: float) -> bytes:
        return self.body

    async def reply_error(self, err: GatewayError, response_started: bool) -> int:
        raise err

    def watch(self) -> None:
        pass

    def linger(self, seconds: float) -> None:
        pass

    def detach(self) -> None:
        pass


async def _discard(message: MutableMapping[str, Any]) -> None:
    pass


@dataclass(frozen=True)
class ProbeResult:
    hot_us: float
    cold_us: float


async def probe(policy_text: str, body: bytes, *, gap_s: float, hot_n: int = 300,
                cold_n: int = 60, cpu: int | None = None) -> ProbeResult:
    """Median microseconds of the work before upstream, back to back and after `gap_s` idle."""
    policy = parse_policy(policy_text)
    metrics = GatewayMetrics()
    session = make_session(policy)
    counters = load_counters(policy)
    rt = build_runtime(policy, metrics, session, MemoryState(), counters, time.time())
    try:
        await rt.backends.probe_all(rt.forwarder.aio.probe)
        pipe = Pipeline(rt)
        loop = asyncio.get_running_loop()

        async def once() -> float:
            t = STAGE_CLOCK()
            inbound = Inbound("chat", "probe", loop.time(), t, _HEADERS)
            ctx = RequestContext(inbound, _Caller(body), timed=True)
            await prepare(pipe.shared, ctx)
            p = ctx.p
            quota = await rt.quotas.take(p.caller.tenant, p.work.quota_tokens, p.route.pool)
            upstream_body(p)
            ticket = await rt.admission.admit(p.ask(loop.time()))
            took = STAGE_CLOCK() - t
            await finish(rt.admission.release(ticket))
            if quota is not None:
                await finish(rt.quotas.settle(quota, quota.taken))
            return took

        with harness.pinned(cpu):
            for _ in range(hot_n):  # warm: the piece cache, the interpreter's specialisation
                await once()
            hot = [await once() for _ in range(hot_n)]
            cold = []
            for _ in range(cold_n):
                await asyncio.sleep(gap_s)  # the CPU idle, as between requests at low load
                cold.append(await once())
        if rt.admission.live:  # each request released as `serve` releases it
            raise RuntimeError(f"the probe left {len(rt.admission.live)} reservations")
        return ProbeResult(harness.median(hot) * 1e6, harness.median(cold) * 1e6)
    finally:
        await session.close()
        for counter in counters.values():
            counter.close()


def chat_body(model: str, content: str) -> bytes:
    return orjson.dumps({"model": model, "max_tokens": 16, "stream": True,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": content}]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="a running stub engine's URL")
    p.add_argument("--gap-ms", type=float, default=35.0)
    p.add_argument("--cpu", type=int, default=None)
    args = p.parse_args()
    for kind, shipped in (("floor", False), ("shipped", True)):
        r = asyncio.run(probe(harness.stub_policy(args.engine, shipped=shipped),
                              chat_body(harness.STUB_MODEL, "Say hello."),
                              gap_s=args.gap_ms / 1e3, cpu=args.cpu))
        print(f"{kind}: {r.hot_us:.0f} us hot, {r.cold_us:.0f} us after {args.gap_ms:g} ms "
              f"idle ({r.cold_us / r.hot_us:.1f}x)")


if __name__ == "__main__":
    main()
