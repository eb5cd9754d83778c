"""A vLLM V1-style scheduler: continuous batching under a token budget with chunked prefill.

Each step (`Scheduler.schedule`), as `vllm/v1/core/sched/scheduler.py` does it:
1. Running requests first, in order: each gets the tokens it still needs (1 for a decode, the
   rest of its prompt for a partial prefill), capped by what is left of `max_num_batched_tokens`.
   When the KV cache cannot hold them, the newest running request is preempted (its blocks
   freed, its progress dropped, it goes back to the front of the waiting queue to be recomputed)
   until the current one fits, or the current one is itself the newest and is preempted.
2. If nothing was preempted this step, waiting requests in FCFS order while there is budget and
   fewer than `max_num_seqs` are running: each first takes its prefix-cache hit, then as much of
   the rest of its prompt as the budget allows (chunked prefill). The first that does not fit in
   the KV cache stops the loop (no skipping ahead).

After the step (`Scheduler.update`), every request whose computed tokens reach its length
samples one token; a request that reaches its target length finishes and frees its blocks.
"""

from __future__ import annotations

import enum
import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtest.sim.kvcache import KVCacheManager

# The vocabulary synthetic token ids are drawn from where the engine names none: inside every
# common model's (Llama 2's 32,000 is the smallest).
SYNTHETIC_VOCAB = 32_000


def synthetic_ids(salt: int, index: int, count: int, vocab_size: int) -> list[int]:
    """`count` token ids in [0, vocab_size), a function of (salt, index) alone."""
    digest = hashlib.blake2b(b"%d:%d" % (salt, index), digest_size=4 * count).digest()
    return [int.from_bytes(digest[i:i + 4], "little") % vocab_size
            for i in range(0, 4 * count, 4)]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One sequence in the engine. Times are whatever clock the caller passes (wall or virtual)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int  # finish_reason "length" when reached
    target_tokens: int  # tokens it will produce: max_tokens, or fewer when it "stops" at EOS
    arrival_time: float
    prompt_hashes: Sequence[int] = ()  # hashes of the prompt's full blocks, in order
    salt: int = 0  # makes the hashes of blocks past the prompt unique to this request
    prompt_ids: Sequence[int] = ()  # the prompt's token ids, when known (for KV events)
    vocab_size: int = SYNTHETIC_VOCAB  # where the ids of unknown tokens are drawn from
    on_progress: Callable[[SimRequest], None] | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prev_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED or self.status is Status.ABORTED

    def block_hash(self, index: int) -> int:
        if index < len(self.prompt_hashes):
            return self.prompt_hashes[index]
        # Blocks holding generated tokens only ever match this request's own recompute.
        return hash((self.salt, index))

    def block_tokens(self, index: int, block_size: int = 16) -> Sequence[int]:
        """Token ids of full block `index` (a KV event carries them). Where the ids are not
        known (generated tokens, a prompt known by length only): ids of the vocabulary, as a
        real engine's, drawn from the request's salt and the block's index, so that a router
        that types ids as the engine does (u32) can read them, and nothing re-hashed from them
        matches another prompt (16 draws from a vocabulary of tens of thousands)."""
        start = index * block_size
        if start + block_size <= len(self.prompt_ids):
            return self.prompt_ids[start:start + block_size]
        return synthetic_ids(self.salt, index, block_size, self.vocab_size)


@dataclass(frozen=True, slots=True)
class Scheduled:
    request: SimRequest
    new_tokens: int
    context_tokens: int  # tokens already in the KV cache before this step


@dataclass(frozen=True, slots=True)
class Batch:
    entries: list[Scheduled]
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(e.new_tokens for e in self.entries)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_preemptions = 0
        self._aborted = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        """Drop a request (client went away); its blocks are freed at the next schedule()."""
        if not request.finished:
            request.status = Status.ABORTED
            request.finish_reason = "abort"
            self._aborted = True

    def abort_all(self) -> list[SimRequest]:
        dropped = [r for r in (*self.running, *self.waiting) if not r.finished]
        for request in dropped:
            self.abort(request)
        self._purge_aborted()
        return dropped

    def schedule(self, now: float) -> Batch:
        if self._aborted:
            self._purge_aborted()
        budget = self.max_num_batched_tokens
        entries: list[Scheduled] = []
        preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            scheduled = True
            while not self.kv.allocate_slots(request, new_tokens):
                victim = self.running.pop()  # FCFS: the newest arrival has the lowest priority
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            entries.append(Scheduled(request, new_tokens, request.num_computed_tokens))
            budget -= new_tokens
            index += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hits = self.kv.computed_blocks(request)
                cached = len(hits) * self.kv.block_size
                new_tokens = min(request.num_tokens - cached, budget)
                if not self.kv.allocate_slots(request, new_tokens, hits):
                    break
                self.waiting.popleft()
                self.kv.queried_tokens += request.num_tokens
                self.kv.hit_tokens += cached
                request.num_computed_tokens = cached
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = cached
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                request.status = Status.RUNNING
                self.running.append(request)
                entries.append(Scheduled(request, new_tokens, cached))
                budget -= new_tokens
        self.num_preemptions += preempted
        return Batch(entries, preempted)

    def update(self, batch: Batch, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Advance the batch's requests; returns (requests that got a token, those finished)."""
        emitted: list[SimRequest] = []
        finished: list[SimRequest] = []
        for entry in batch.entries:
            request = entry.request
            if request.status is not Status.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += entry.new_tokens
            self.kv.register_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no token until the whole prompt is in
            request.num_output_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            request.prev_token_time = request.last_token_time
            request.last_token_time = now
            emitted.append(request)
            if request.num_output_tokens >= request.target_tokens:
                request.status = Status.FINISHED
                request.finish_reason = (
                    "length" if request.num_output_tokens >= request.max_tokens else "stop")
                request.finish_time = now
                self.kv.free(request)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return emitted, finished

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def _purge_aborted(self) -> None:
        for request in self.running:
            if request.status is Status.ABORTED:
                self.kv.free(request)
        self.running = [r for r in self.running if r.status is Status.RUNNING]
        if any(r.status is Status.ABORTED for r in self.waiting):
            for request in self.waiting:
                if request.status is Status.ABORTED and request.blocks:
                    self.kv.free(request)
            self.waiting = deque(r for r in self.waiting if r.status is Status.WAITING)
        self._aborted = False
