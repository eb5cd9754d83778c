"""The prefix-routing metrics (issue 19), registered beside the others in GatewayMetrics.

Predicted and engine-reported cached tokens are counted over the same requests (those whose
engine usage was read), so `predicted / prompt` and `engine_cached / prompt` compare like for
like per backend: the Grafana panel "predicted vs measured prefix hit rate" divides them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.observe.children import LabelChildren

PLACED_BY = ("prefix", "affinity", "headroom")


class PrefixMetrics:
    def __init__(self, r: CollectorRegistry, child: LabelChildren) -> None:
        self.child = child  # the gateway's table of bound children (gateway/observe/children.py)
        self.prompt_tokens = Counter(
            "gateway_prefix_prompt_tokens_total", "Prompt tokens (the engine's count) of "
            "requests placed in pools that route by prefix.", ["pool", "backend"], registry=r)
        self.predicted_cached = Counter(
            "gateway_prefix_predicted_cached_tokens_total", "Prompt tokens the gateway "
            "predicted in the chosen backend's prefix cache (x-gateway-cached-tokens), for the "
            "same requests.", ["pool", "backend"], registry=r)
        self.engine_cached = Counter(
            "gateway_prefix_engine_cached_tokens_total", "Prompt tokens the engine reported "
            "served from its cache (usage.prompt_tokens_details.cached_tokens), for the same "
            "requests.", ["pool", "backend"], registry=r)
        self.placements = Counter(
            "gateway_prefix_placements_total", "Requests placed in pools that route by prefix, "
            "by what chose the backend: prefix (a cached prefix scored), affinity (the "
            "session's hash), headroom (nothing cached anywhere: as without prefix routing).",
            ["pool", "by"], registry=r)
        self.shadow = Counter(
            "gateway_prefix_shadow_total", "routing.prefix.mode shadow: whether the prefix "
            "router would have chosen the backend headroom chose (agreed true/false).",
            ["pool", "agreed"], registry=r)
        self.shadow_cached = Counter(
            "gateway_prefix_shadow_cached_tokens_total", "Shadow mode: prompt tokens predicted "
            "cached at the backend the prefix router would have chosen.", ["pool"], registry=r)
        self.index_blocks = Gauge(
            "gateway_prefix_index_blocks", "Blocks in the backend's prefix index.",
            ["pool", "backend"], registry=r, multiprocess_mode="livemax")
        self.index_forgotten = Counter(
            "gateway_prefix_index_forgotten_total", "Times a backend's prefix index was "
            "cleared: ejected, down (probe failed) or restarted (its prefix counters fell).",
            ["pool", "backend", "why"], registry=r)
        self.engine_queries = Counter(
            "gateway_engine_prefix_cache_queries_tokens_total", "The engine's own "
            "vllm:prefix_cache_queries (tokens looked up), scraped.", ["pool", "backend"],
            registry=r)
        self.engine_hits = Counter(
            "gateway_engine_prefix_cache_hits_tokens_total", "The engine's own "
            "vllm:prefix_cache_hits (tokens served from its cache), scraped.",
            ["pool", "backend"], registry=r)
        self.engine_hit_rate = Gauge(
            "gateway_engine_prefix_cache_hit_ratio", "SGLang's own sglang:cache_hit_rate, "
            "scraped.", ["pool", "backend"], registry=r, multiprocess_mode="livemostrecent")
