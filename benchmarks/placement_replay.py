"""Which placement rule, with which weights: an offline replay of whole traces (issue 19).

The end-to-end benchmark (prefix_routing.py) runs real processes and so only samples of the
Mooncake trace; whether a rule reaches the hits a workload holds depends on the whole trace's
pressure on the engines' caches. This replays every request of a workload in its own order and
times through a model of the pool, placing each with the rule being compared, and prints the
share of prompt tokens served from cache, TTFT, and the balance of load:

  engines   ENGINES replicas of the 70B reference (Llama-3.3-70B, TP=4 on H100), each an LRU
            cache of its KV capacity (470,720 tokens) at 512-token blocks (the trace's hash
            ids), a request's blocks tail first out; a FIFO prefill queue at the step model's
            prefill rate (loadtest/sim/steptime.py), only the part of the prompt not cached
            prefilled; then its output at the step model's decode time, in flight meanwhile.
  view      what the gateway sees of each backend when it places a request (admission's
            BackendView): the predicted cached tokens, its tokens in flight (prompt + output),
            its prefill backlog (the uncached prompt tokens admitted with no first token yet),
            its KV headroom.
  rules     headroom: most KV headroom first (prefix routing off: (a) of prefix_routing.py);
            round-robin; bound: the issue's reference router, the longest cached prefix among
            backends within max(1.1 x the mean, the mean + 8,192) in-flight tokens (what
            prefix_routing.py's `lru_replay` calls the bound); cost(w, eps, slack): the
            shipped `gateway.routing.router.prefix_order` with PrefixRule(w, eps, slack); and, as
            the ceiling, one cache of all the engines' capacity.

Balance is each engine's in-flight tokens averaged over time, max / mean (as prefix_routing.py
reads KV usage over a run). Deterministic: no processes, no clocks; ~1 minute a rule on the
whole Mooncake trace (12,031 requests).

    .venv/bin/python benchmarks/placement_replay.py [--workloads mooncake,multiturn] [--stretch 1.5]
        [--multiturn conversations=300,turns=6,system=512,turn=2048,think=2,start=6]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness

# The end-to-end benchmark's pool and its reference router, so both model the same thing.
from benchmarks.prefix_routing import (
    ENGINES,
    EPSILON,
    HASH_BLOCK,
    MODEL,
    MOONCAKE,
    OUTPUT_CAP,
    SLACK_TOKENS,
    TP,
)
from gateway.admission.decision import BackendView
from gateway.cost.traces import open_trace
from gateway.routing.router import PrefixRule, most_headroom_first, prefix_order
from loadtest.sim.config import SimConfig
from loadtest.sim.steptime import StepTimeModel
from loadtest.workload import (
    MultiTurn,
    WorkloadError,
    multiturn_items,
    parse_multiturn,
)

BLOCK = HASH_BLOCK          # the traces' hash ids each stand for 512 prompt tokens
OUTPUT = OUTPUT_CAP         # decode is not what the prefix cache changes


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float
    chain: tuple[int, ...]  # chained hashes of its 512-token blocks, the partial last one too
    prompt: int


def chained(ids: Sequence[int]) -> tuple[int, ...]:
    out, parent = [], None
    for h in ids:
        parent = hash((parent, h))
        out.append(parent)
    return tuple(out)


def mooncake(stretch: float) -> list[Request]:
    with open_trace(MOONCAKE) as f:
        rows = [json.loads(line) for line in f]
    return [Request(r["timestamp"] / 1000 * stretch, chained(r["hash_ids"]), r["input_length"])
            for r in rows]


def multiturn(mt: MultiTurn, seed: int = 2) -> list[Request]:
    return [Request(i.arrival_s, chained(i.block_hashes), i.prompt_tokens)
            for i in multiturn_items(mt, seed)]


@dataclass
class Engine:
    cache: OrderedDict[int, None]
    free_at: float = 0.0  # its prefill queue's end
    running: list[tuple[float, int]] = field(default_factory=list)  # (leaves at, in flight)
    prefilling: list[tuple[float, int]] = field(default_factory=list)  # (first token, uncached)
    load_s: float = 0.0  # in-flight tokens x seconds


@dataclass(frozen=True, slots=True)
class Result:
    hit: float
    ttft: tuple[float, float, float]   # P50, P90, P99 (s, real)
    balance: float


Rule = Callable[[list[BackendView], Request, int], str]


def replay(reqs: Sequence[Request], rule: Rule, capacity_blocks: int, prefill_tok_s: float,
           decode_s: float, one_cache: bool = False) -> Result:
    """`one_cache`: the engines share one LRU cache of all their capacity, the most any
    routing could reach (no engine ever recomputes what another holds)."""
    shared: OrderedDict[int, None] = OrderedDict()
    engines = [Engine(shared if one_cache else OrderedDict()) for _ in range(ENGINES)]
    room = capacity_blocks * (ENGINES if one_cache else 1)
    limit_blocks = capacity_blocks * BLOCK // 16
    hit = total = 0
    ttfts: list[float] = []
    last = reqs[0].at_s if reqs else 0.0
    for n, r in enumerate(reqs):
        views = []
        for i, e in enumerate(engines):
            e.running[:] = [x for x in e.running if x[0] > r.at_s]
            e.prefilling[:] = [x for x in e.prefilling if x[0] > r.at_s]
            inflight = sum(t for _, t in e.running)
            e.load_s += inflight * (r.at_s - last)
            held = 0
            for h in r.chain[: r.prompt // BLOCK]:
                if h not in e.cache:
                    break
                held += 1
            views.append(BackendView(
                name=str(i), available=True, limit_blocks=limit_blocks,
                reserved_blocks=inflight // 16, outstanding=len(e.running), ruled_out=None,
                over_static_rule=False, cached_tokens=min(held * BLOCK, r.prompt - 1),
                inflight_tokens=inflight,
                prefill_tokens=sum(t for _, t in e.prefilling)))
        last = r.at_s
        i = int(rule(views, r, n))
        e, cached = engines[i], views[i].cached_tokens
        hit += cached
        total += r.prompt
        first = max(r.at_s, e.free_at) + (r.prompt - cached) / prefill_tok_s
        e.free_at = first
        ttfts.append(first - r.at_s)
        e.prefilling.append((first, r.prompt - cached))
        e.running.append((first + decode_s, r.prompt + OUTPUT))
        for h in reversed(r.chain):  # tail first out, as the engine
            e.cache[h] = None
            e.cache.move_to_end(h)
        while len(e.cache) > room:
            e.cache.popitem(last=False)
    means = [e.load_s for e in engines]
    avg = sum(means) / len(means)
    p50, p90, p99 = (harness.percentile(ttfts, q) for q in (50, 90, 99))
    return Result(hit / total if total else 0.0, (p50, p90, p99), max(means) / avg if avg else 1.0)


def headroom(views: list[BackendView], r: Request, n: int) -> str:
    return most_headroom_first(views)[0].name


def round_robin(views: list[BackendView], r: Request, n: int) -> str:
    return views[n % len(views)].name


def bound(views: list[BackendView], r: Request, n: int) -> str:
    ask = r.prompt + OUTPUT
    loads = [v.inflight_tokens for v in views]
    mean = (sum(loads) + ask) / len(views)
    top = max((1 + EPSILON) * mean, mean + SLACK_TOKENS)
    ok = [v for v in views if v.inflight_tokens + ask <= top or v.inflight_tokens == min(loads)]
    return max(ok, key=lambda v: (v.cached_tokens, -v.inflight_tokens)).name


def cost(rule: PrefixRule) -> Rule:
    def place(views: list[BackendView], r: Request, n: int) -> str:
        return prefix_order(views, rule, r.prompt + OUTPUT, r.prompt)[0].name
    return place


def rules() -> dict[str, Rule]:
    d = PrefixRule()
    out: dict[str, Rule] = {"headroom (a)": headroom, "round robin": round_robin,
                            "bound (issue's)": bound}
    for w in (0.25, 0.5, 1.0):
        out[f"cost w={w:g}, eps={d.epsilon:g}, slack={d.slack_tokens}"] = \
            cost(replace(d, inflight_weight=w))
    out[f"cost w={d.inflight_weight:g}, eps=0.1, slack=8192"] = \
        cost(replace(d, epsilon=0.1, slack_tokens=8192))
    out[f"cost w={d.inflight_weight:g}, no bound"] = cost(replace(d, epsilon=1e9))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="mooncake,multiturn")
    ap.add_argument("--multiturn", action="append", metavar="SPEC",
                    help="a multi-turn shape instead of the four built in, as loadtest's "
                         "--multiturn takes it (conversations=N,turns=K,system=,turn=,think=,"
                         "start=); repeatable")
    ap.add_argument("--stretch", type=float, action="append",
                    help="the Mooncake trace's times x this (default 1.2 and 1.5: the trace "
                         "at 0.93 and 0.75 of the four engines' prefill rate)")
    ap.add_argument("--out", metavar="FILE.json", help="every rule's figures as JSON too")
    args = ap.parse_args()
    results: dict[str, Any] = {"machine": harness.machine(), "workloads": {}}
    spec = SimConfig(model=MODEL, tp=TP).resolve()
    steps = StepTimeModel(spec.model, spec.gpu, TP, spec.dtype, spec.kv_dtype)
    prefill = 8192 / steps.prefill_s(8192)
    decode = OUTPUT * steps.decode_step_s(32, 8192)
    capacity = spec.num_gpu_blocks * spec.block_size // BLOCK
    print(f"{ENGINES} x {MODEL} TP={TP}: KV {capacity} blocks of {BLOCK} tokens each, prefill "
          f"{prefill:,.0f} tokens/s, {OUTPUT} output tokens in {decode:.2f} s (step model)")
    workloads: list[tuple[str, list[Request]]] = []
    names = args.workloads.split(",")
    if "mooncake" in names:
        for stretch in args.stretch or [1.2, 1.5]:
            reqs = mooncake(stretch)
            rate = sum(r.prompt for r in reqs) / reqs[-1].at_s
            workloads.append((f"mooncake, whole trace, times x {stretch:g} ({len(reqs):,} "
                              f"requests, {rate / (ENGINES * prefill):.2f} of the prefill rate)",
                              reqs))
    if "multiturn" in names:
        try:
            given = [replace(parse_multiturn(spec), out=OUTPUT) for spec in args.multiturn or ()]
        except WorkloadError as exc:
            ap.error(str(exc))
        shapes = given or [
            MultiTurn(20, 6, 512, 2048, OUTPUT, 1.0, 1.0),   # prefix_routing.py's
            MultiTurn(60, 6, 512, 2048, OUTPUT, 1.0, 1.0),
            MultiTurn(32, 12, 2048, 1024, OUTPUT, 3.0, 1.0),  # loadtest's default
            MultiTurn(128, 12, 2048, 1024, OUTPUT, 3.0, 2.0)]
        for mt in shapes:
            reqs = multiturn(mt)
            workloads.append((f"{mt.describe()} ({len(reqs):,} requests)", reqs))
    for title, reqs in workloads:
        print(f"\n{title}")
        print(f"  {'rule':<36} {'hit':>6} {'x (a)':>6} {'TTFT P50':>9} {'P90':>7} {'P99':>7} "
              f"{'balance':>8}")
        base = None
        for name, rule in [*rules().items(), ("one cache of all four (headroom)", headroom)]:
            res = replay(reqs, rule, capacity, prefill, decode, one_cache=name.startswith("one"))
            base = base if base is not None else res.hit
            p50, p90, p99 = res.ttft
            print(f"  {name:<36} {100 * res.hit:5.1f}% {res.hit / base if base else 0:5.2f}x "
                  f"{p50:8.2f}s {p90:6.2f}s {p99:6.2f}s {res.balance:8.2f}", flush=True)
            results["workloads"].setdefault(title, {})[name] = {
                "hit": res.hit, "ttft_p50_p90_p99_s": res.ttft, "balance": res.balance}
    if args.out:
        harness.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
