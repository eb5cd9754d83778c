"""`/metrics` with vLLM V1's metric names, labels, meanings and histogram buckets.

Labels are `model_name` and `engine` (always "0": one engine core), as in
`vllm/v1/metrics/loggers.py`; `vllm:cache_config_info` is vLLM's info-style gauge (value 1)
whose labels carry the cache configuration and, like vLLM's, no `model_name`. Each app has its
own `CollectorRegistry`, so several engines can run in one process (the gateway demo).

Latencies are wall-clock seconds as the server experiences them: with `--time-scale X` they are
X times the simulated engine's latencies, which is what a client or gateway in front measures too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadtest.sim.config import EngineSpec
from loadtest.sim.engine import EngineCore, StepEvents
from loadtest.sim.scheduler import SimRequest

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class SimMetrics:
    def __init__(self, spec: EngineSpec) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (spec.served_model_name, "0")
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.").labels(*values)
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.").labels(*values)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.").labels(*values)
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine."
                                   ).labels(*values)
        self.prompt_tokens = counter("vllm:prompt_tokens",
                                     "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(*values)
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(*values)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.").labels(*values)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*labels, "finished_reason"), registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS).labels(*values)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS).labels(*values)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS).labels(*values)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS).labels(*values)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     ("block_size", "cache_dtype", "enable_prefix_caching",
                      "gpu_memory_utilization", "num_gpu_blocks", "kv_cache_size_tokens",
                      "engine"), registry=r)
        # kv_cache_size_tokens as vLLM 0.32 writes it (one attention group: blocks x size).
        info.labels(str(spec.block_size), "auto" if spec.kv_dtype == "bf16" else "fp8",
                    str(spec.enable_prefix_caching), str(spec.gpu_memory_utilization),
                    str(spec.num_gpu_blocks), str(spec.num_gpu_blocks * spec.block_size),
                    "0").set(1)
        self._prefix_seen = (0, 0)

    def observe_step(self, core: EngineCore, events: StepEvents) -> None:
        self.running.set(core.num_running)
        self.waiting.set(core.num_waiting)
        self.kv_usage.set(core.kv_usage)
        if events.num_preempted:
            self.preemptions.inc(events.num_preempted)
        if events.prompt_tokens:
            self.prompt_tokens.inc(events.prompt_tokens)
        if events.emitted:
            self.generation_tokens.inc(len(events.emitted))
        itl = self.itl.observe
        for request in events.emitted:
            if request.prev_token_time is not None and request.last_token_time is not None:
                itl(request.last_token_time - request.prev_token_time)
            elif request.first_token_time is not None:
                self.ttft.observe(request.first_token_time - request.arrival_time)
        for request in events.finished:
            self.observe_finished(request)
        queried, hit = core.kv.queried_tokens, core.kv.hit_tokens
        if (queried, hit) != self._prefix_seen:
            self.prefix_queries.inc(queried - self._prefix_seen[0])
            self.prefix_hits.inc(hit - self._prefix_seen[1])
            self._prefix_seen = (queried, hit)

    def observe_state(self, core: EngineCore) -> None:
        self.running.set(core.num_running)
        self.waiting.set(core.num_waiting)
        self.kv_usage.set(core.kv_usage)

    def observe_finished(self, request: SimRequest) -> None:
        reason = request.finish_reason or "abort"
        if reason in self.success:
            self.success[reason].inc()
        if request.finish_time is not None:
            self.e2e.observe(request.finish_time - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue.observe(request.first_scheduled_time - request.arrival_time)

    def render(self) -> bytes:
        # vLLM turns off prometheus_client's `_created` series; that switch is process-global
        # (it would change a gateway running in the same process), so drop them here instead.
        text = generate_latest(self.registry)
        return b"\n".join(line for line in text.split(b"\n")
                          if b"_created{" not in line and b"_created " not in line)
