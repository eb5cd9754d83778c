"""The engine core: scheduler, KV cache and step-time model, driven by any clock.

A step is two calls so that the caller owns time:

    step = core.begin_step(now)      # schedule a batch; step.duration_s is its simulated length
    ...                              # the server sleeps duration x time_scale; a replay adds it
    events = core.finish_step(step, now)   # tokens sampled at the end of the step

Nothing here knows about HTTP or asyncio, so the fidelity benchmark runs the same code on a
virtual clock (deterministic, thousands of simulated seconds per wall second), and the server runs
it on the event loop's clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.sim.config import EngineSpec
from loadtest.sim.kvcache import KVCacheManager
from loadtest.sim.scheduler import Batch, Scheduler, SimRequest
from loadtest.sim.steptime import StepTime, StepTimeModel


@dataclass(frozen=True, slots=True)
class Step:
    batch: Batch
    time: StepTime
    started_at: float

    @property
    def duration_s(self) -> float:
        return self.time.total_s


@dataclass(frozen=True, slots=True)
class StepEvents:
    emitted: list[SimRequest]  # each got exactly one new token
    finished: list[SimRequest]
    num_preempted: int
    prompt_tokens: int  # prompts whose first token came this step (vllm:prompt_tokens_total)


class EngineCore:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.kv = KVCacheManager(spec.num_gpu_blocks, spec.block_size, spec.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, spec.max_num_seqs, spec.max_num_batched_tokens)
        self.step_time = StepTimeModel(spec.model, spec.gpu, spec.tp, spec.dtype, spec.kv_dtype)
        self.steps = 0
        self.busy_s = 0.0

    # -- requests -----------------------------------------------------------------------------
    def add(self, request: SimRequest) -> None:
        self.scheduler.add(request)

    def abort(self, request: SimRequest) -> None:
        self.scheduler.abort(request)

    def abort_all(self) -> list[SimRequest]:
        return self.scheduler.abort_all()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    # -- state --------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    # -- stepping -----------------------------------------------------------------------------
    def begin_step(self, now: float) -> Step | None:
        """Schedule the next batch; None when nothing can run (idle, or all aborted)."""
        batch = self.scheduler.schedule(now)
        if not batch.entries:
            return None
        time = self.step_time.step((e.new_tokens, e.context_tokens) for e in batch.entries)
        return Step(batch, time, now)

    def finish_step(self, step: Step, now: float) -> StepEvents:
        emitted, finished = self.scheduler.update(step.batch, now)
        self.steps += 1
        self.busy_s += step.duration_s
        prompt_tokens = sum(r.prompt_tokens for r in emitted if r.num_output_tokens == 1)
        return StepEvents(emitted, finished, step.batch.num_preempted, prompt_tokens)
