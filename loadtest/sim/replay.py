"""Run the engine core on a virtual clock over a workload: no server, no sleeping.

Used by `benchmarks/sim_fidelity.py` and for capacity what-ifs: a thousand requests of a 70B
model replay in well under a second, and the same inputs always give the same numbers.

Two load shapes, as serving benchmarks use them:
- open loop: requests arrive at given times (`request_rate`, Poisson or all at once);
- closed loop: `concurrency` clients, each sending its next request when the previous finishes.
A request reaches the engine's waiting queue `frontend_s` after it arrives (the API server's
time, `steptime.FRONTEND_LATENCY_S`); one that reaches it while a step runs is scheduled at the
next step, as in a real engine. Latencies (TTFT, E2E) count from the arrival, as a client does.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.sim.config import EngineSpec
from loadtest.sim.engine import EngineCore
from loadtest.sim.scheduler import SimRequest
from loadtest.sim.steptime import FRONTEND_LATENCY_S


@dataclass(frozen=True, slots=True)
class WorkItem:
    prompt_tokens: int
    output_tokens: int
    prompt_hashes: tuple[int, ...] = ()


@dataclass(slots=True)
class RequestTrace:
    item: WorkItem
    arrival: float
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    queued_s: float = 0.0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    traces: list[RequestTrace]
    makespan_s: float
    steps: int
    preemptions: int
    peak_kv_usage: float
    peak_running: int
    peak_waiting: int

    @property
    def output_tokens(self) -> int:
        return sum(len(t.token_times) for t in self.traces)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s else 0.0

    def median_ttft(self) -> float:
        return statistics.median(t.ttft for t in self.traces)

    def median_tpot(self) -> float:
        return statistics.median(x for t in self.traces if (x := t.tpot) is not None)

    def median_itl(self) -> float:
        return statistics.median(x for t in self.traces for x in t.itls())


def replay(spec: EngineSpec, arrivals: Sequence[tuple[float, WorkItem]] = (),
           closed_loop: Sequence[WorkItem] = (), concurrency: int = 0,
           frontend_s: float = FRONTEND_LATENCY_S) -> ReplayResult:
    """Open-loop `arrivals` (time, item), and/or a closed loop of `concurrency` clients that
    work through `closed_loop` in order. Returns once every request has finished.
    `frontend_s`: from a request's arrival to its entry into the engine's waiting queue."""
    core = EngineCore(spec)
    heap: list[tuple[float, int, float, WorkItem]] = []  # (enters the engine, seq, arrival, item)
    seq = itertools.count()
    for at, item in arrivals:
        heapq.heappush(heap, (at + frontend_s, next(seq), at, item))
    backlog = iter(closed_loop)
    for item in itertools.islice(backlog, concurrency):
        heapq.heappush(heap, (frontend_s, next(seq), 0.0, item))

    traces: dict[str, RequestTrace] = {}  # by request id (id() of a freed request is reused)
    now = 0.0
    peak_usage = 0.0
    peak_running = peak_waiting = 0
    while True:
        while heap and heap[0][0] <= now:
            _, n, at, item = heapq.heappop(heap)
            request = SimRequest(
                request_id=str(n), prompt_tokens=item.prompt_tokens,
                max_tokens=item.output_tokens, target_tokens=item.output_tokens,
                arrival_time=at, prompt_hashes=item.prompt_hashes, salt=n)
            traces[request.request_id] = RequestTrace(item, at)
            core.add(request)
        step = core.begin_step(now)
        if step is None:
            if not heap:
                break
            now = heap[0][0]
            continue
        peak_usage = max(peak_usage, core.kv_usage)
        peak_running = max(peak_running, core.num_running)
        peak_waiting = max(peak_waiting, core.num_waiting)
        now += step.duration_s
        events = core.finish_step(step, now)
        for request in events.emitted:
            traces[request.request_id].token_times.append(now)
        for request in events.finished:
            trace = traces[request.request_id]
            trace.preemptions = request.num_preemptions
            trace.queued_s = (request.first_scheduled_time or now) - request.arrival_time
            nxt = next(backlog, None)
            if nxt is not None:
                heapq.heappush(heap, (now + frontend_s, next(seq), now, nxt))
    ordered = [traces[k] for k in sorted(traces, key=lambda k: traces[k].arrival)]
    return ReplayResult(ordered, now, core.steps, core.scheduler.num_preemptions, peak_usage,
                        peak_running, peak_waiting)
