"""Engine /metrics read right in every layout the engines export (issue 17).

The pages below are in the engines' own shape: HELP/TYPE lines, label sets and label order as
vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py) and SGLang's SchedulerMetricsCollector
(python/sglang/srt/metrics/collector.py, behind prometheus_client's multiprocess collector,
which sorts labels and writes "Multiprocess metric" as HELP) render them, with the histogram
and process lines around them that the parser must skip.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from gateway.admission.controller import Admission, Ask, Overloaded
from gateway.observe.metrics import GatewayMetrics
from gateway.policy import parse_policy
from gateway.routing.backends import Backends
from gateway.signals.engines import EngineScraper, parse_engine_metrics, parse_llamacpp_props
from gateway.state import MemoryState
from loadtest.sim.config import SimConfig
from loadtest.sim.metrics import SimMetrics

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# vLLM >= 0.11, one engine core: the deprecated gpu_cache_usage_perc is gone.
VLLM_SINGLE = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; \
awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 \
means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{{engine="0",model_name="{MODEL}",sleep_state="awake"}} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried \
tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 52000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="{MODEL}"}} 140.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 152.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 152.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{MODEL}"}} 9.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",\
is_attention_free="False",kv_cache_dtype_skip_layers="[]",num_cpu_blocks="None",\
num_gpu_blocks="27000",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",\
sliding_window="None"}} 1.0
"""

# vLLM 0.9/0.10: every engine core exports the renamed KV-usage gauge and the deprecated one,
# with the same value (PrometheusStatLogger.record sets both from kv_cache_usage).
VLLM_010_BOTH_NAMES = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: \
Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.6
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of \
queriedtokens. DEPRECATED: Use vllm:prefix_cache_queries instead.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 4096.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.6
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
cpu_kvcache_space_bytes="None",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",is_attention_free="False",kv_sharing_fast_prefill="False",\
mamba_cache_dtype="auto",mamba_ssm_cache_dtype="auto",num_cpu_blocks="None",\
num_gpu_blocks="27000",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",\
sliding_window="None",swap_space="4",swap_space_bytes="4294967296"}} 1.0
"""

# vLLM V0 (and 0.8): the old name alone, labels model_name only, no engine label.
VLLM_V0 = f"""\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",cpu_offload_gb="0",\
enable_prefix_caching="False",gpu_memory_utilization="0.9",is_attention_free="False",\
num_cpu_blocks="4096",num_gpu_blocks="10947",num_gpu_blocks_override="None",\
sliding_window="None",swap_space_bytes="4294967296"}} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{MODEL}"}} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{model_name="{MODEL}"}} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="{MODEL}"}} 4.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.4
"""

# vLLM 0.10, --data-parallel-size 2 in one server: one series per engine core (`engine`), both
# KV-usage names, and one cache_config_info line per engine. Each line carries the front end's
# CacheConfig, whose num_gpu_blocks vLLM summed over both engines at startup (27000 each).
VLLM_DP2 = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: \
Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.6
vllm:gpu_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.7
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.6
vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.7
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 0.0
vllm:num_preemptions_total{{engine="1",model_name="{MODEL}"}} 2.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",\
is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="54000",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",\
swap_space="4",swap_space_bytes="4294967296"}} 1.0
vllm:cache_config_info{{block_size="16",cache_dtype="auto",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",\
is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="54000",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",\
swap_space="4",swap_space_bytes="4294967296"}} 1.0
"""


def vllm_hybrid(engines: int, kv_tokens: str = "327680") -> str:
    """Newest vLLM serving a hybrid attention/Mamba model: block_size enlarged to the Mamba page
    (544), and the group-aware kv_cache_size_tokens (per engine; 5 x max_model_len 65536) that
    num_gpu_blocks x block_size (556 x 544 = 302464, summed over engines) does not give."""
    lines = [
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        *(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="Qwen/Qwen3-Next-80B-A3B"}} 0.5'
          for e in range(engines)),
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
    ]
    for e in range(engines):
        lines.append(
            'vllm:cache_config_info{block_size="544",cache_dtype="auto",'
            'effective_attention_block_size="544",enable_prefix_caching="True",'
            f'engine="{e}",gpu_memory_utilization="0.9",is_attention_free="False",'
            'kv_cache_max_concurrency="5.0",kv_cache_memory_bytes="None",'
            f'kv_cache_size_tokens="{kv_tokens}",kv_offloading_backend="native",'
            'kv_offloading_size="None",mamba_block_size="544",mamba_cache_dtype="auto",'
            'mamba_cache_mode="align",mamba_page_size_padded="None",num_cpu_blocks="None",'
            f'num_gpu_blocks="{556 * engines}",num_gpu_blocks_override="None",'
            'prefix_caching_hash_algo="sha256",sliding_window="None"} 1.0')
    return "\n".join(lines) + "\n"


SG_MODEL = "Qwen/Qwen2.5-7B-Instruct"


class Rank(NamedTuple):
    """One SGLang scheduler process that exports its gauges."""
    dp: int | None  # dp_rank, None where SGLang sets no such label
    tp: int
    usage: float  # token_usage
    running: int  # num_running_reqs
    queued: int  # num_queue_reqs
    tokens: int  # max_total_num_tokens


def sglang_page(ranks: list[Rank]) -> str:
    """SGLang's scheduler gauges, one series per exporting scheduler, labels as
    SchedulerMetricsMixin.init_metrics sets them, sorted by the multiprocess collector."""
    def labels(r: Rank) -> str:
        dp_label = f'dp_rank="{r.dp}",' if r.dp is not None else ""
        return (f'{{{dp_label}engine_type="unified",model_name="{SG_MODEL}",moe_ep_rank="0",'
                f'pp_rank="0",tp_rank="{r.tp}"}}')

    out = [
        "# HELP sglang:prompt_tokens_total Multiprocess metric",
        "# TYPE sglang:prompt_tokens_total counter",
        f'sglang:prompt_tokens_total{{model_name="{SG_MODEL}"}} 182734.0',
        "# HELP sglang:time_to_first_token_seconds Multiprocess metric",
        "# TYPE sglang:time_to_first_token_seconds histogram",
        f'sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="{SG_MODEL}"}} 17.0',
        f'sglang:time_to_first_token_seconds_count{{model_name="{SG_MODEL}"}} 40.0',
    ]
    for name, field in (("sglang:num_running_reqs", "running"), ("sglang:num_used_tokens", ""),
                        ("sglang:token_usage", "usage"), ("sglang:gen_throughput", ""),
                        ("sglang:num_queue_reqs", "queued"),
                        ("sglang:max_total_num_tokens", "tokens")):
        out += [f"# HELP {name} Multiprocess metric", f"# TYPE {name} gauge"]
        out += [f"{name}{labels(r)} {float(getattr(r, field)) if field else 1234.0}"
                for r in ranks]
    return "\n".join(out) + "\n"


# --- vLLM --------------------------------------------------------------------------------------

def test_vllm_single_engine() -> None:
    s = parse_engine_metrics(VLLM_SINGLE, "vllm", 1.0)
    assert (s.running, s.waiting, s.kv_usage) == (3.0, 1.0, 0.25)
    assert (s.num_gpu_blocks, s.block_size, s.max_tokens, s.engines) == (27000, 16, None, 1)


def test_vllm_old_and_new_usage_names_are_one_quantity() -> None:
    s = parse_engine_metrics(VLLM_010_BOTH_NAMES, "vllm", 1.0)
    assert s.kv_usage == pytest.approx(0.6)  # summed, both names read 1.2
    assert (s.running, s.waiting, s.num_gpu_blocks, s.engines) == (5.0, 0.0, 27000, 1)
    # The deprecated name is read where it is the only one (vLLM V0, 0.8).
    v0 = parse_engine_metrics(VLLM_V0, "vllm", 1.0)
    assert (v0.running, v0.waiting, v0.kv_usage) == (2.0, 4.0, 0.4)
    assert (v0.num_gpu_blocks, v0.block_size, v0.engines) == (10947, 16, 1)


def test_vllm_data_parallel_engines_combine_as_vllm_does() -> None:
    s = parse_engine_metrics(VLLM_DP2, "vllm", 1.0)
    assert s.kv_usage == pytest.approx(0.65)  # the mean over engines, not 0.6 + 0.7 (or 2.6)
    assert (s.running, s.waiting) == (7.0, 3.0)  # the sum over engines
    assert (s.num_gpu_blocks, s.block_size, s.engines) == (54000, 16, 2)  # taken once


def test_vllm_kv_cache_size_tokens() -> None:
    one = parse_engine_metrics(vllm_hybrid(1), "vllm", 1.0)
    assert (one.max_tokens, one.num_gpu_blocks, one.block_size) == (327680, 556, 544)
    assert (one.kv_usage, one.engines) == (0.5, 1)
    # Per engine in vLLM: summed over data-parallel engines (num_gpu_blocks is already a sum).
    two = parse_engine_metrics(vllm_hybrid(2), "vllm", 1.0)
    assert (two.max_tokens, two.num_gpu_blocks, two.kv_usage, two.engines) == \
        (655360, 1112, 0.5, 2)
    # Unset (attention-free or encoder-only models) renders as "None": blocks are used instead.
    none = parse_engine_metrics(vllm_hybrid(1, kv_tokens="None"), "vllm", 1.0)
    assert (none.max_tokens, none.num_gpu_blocks) == (None, 556)


def test_simulator_page_reads_as_one_vllm_engine() -> None:
    spec = SimConfig(num_gpu_blocks=128, max_model_len=1024).resolve()
    sim = SimMetrics(spec)
    sim.kv_usage.set(0.5)
    sim.running.set(2)
    s = parse_engine_metrics(sim.render().decode(), "vllm", 1.0)
    assert (s.running, s.waiting, s.kv_usage) == (2.0, 0.0, 0.5)
    assert (s.num_gpu_blocks, s.block_size, s.engines) == (128, spec.block_size, 1)


def test_lines_are_read_by_the_exposition_format_not_by_position() -> None:
    page = ('vllm:kv_cache_usage_perc{model_name="a b, {c}",engine="0"} 0.5 1712345678000\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} NaN\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
            'vllm:num_requests_running_total{engine="0"} 99\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks_override="7"} 1.0\n')
    s = parse_engine_metrics(page, "vllm", 1.0)
    assert (s.kv_usage, s.waiting, s.running) == (0.5, None, 2.0)
    assert (s.block_size, s.num_gpu_blocks) == (32, None)
    assert parse_engine_metrics(VLLM_SINGLE, "openai", 1.0) == parse_engine_metrics("", "vllm", 1.0)


# --- SGLang ------------------------------------------------------------------------------------

def test_sglang_tp1() -> None:
    s = parse_engine_metrics(sglang_page([Rank(None, 0, 0.31, 5, 2, 400000)]), "sglang", 1.0)
    assert (s.running, s.waiting, s.kv_usage, s.max_tokens, s.engines) == \
        (5.0, 2.0, 0.31, 400000, 1)
    assert (s.num_gpu_blocks, s.block_size) == (None, None)


def test_sglang_tp2_all_ranks_exporting_is_one_pool() -> None:
    # --enable-metrics-for-all-schedulers: both TP ranks report the same group's state.
    page = sglang_page([Rank(None, 0, 0.31, 5, 2, 400000), Rank(None, 1, 0.31, 5, 2, 400000)])
    s = parse_engine_metrics(page, "sglang", 1.0)
    assert (s.running, s.waiting, s.kv_usage, s.max_tokens, s.engines) == \
        (5.0, 2.0, 0.31, 400000, 1)  # summed, it read 10, 4, 0.62 and 800000


def test_sglang_dp2() -> None:
    # --dp-size 2 (the data-parallel controller passes dp_rank), TP=2 each, all ranks exporting.
    page = sglang_page([Rank(0, 0, 0.2, 3, 1, 400000), Rank(0, 1, 0.2, 3, 1, 400000),
                        Rank(1, 0, 0.4, 5, 2, 400000), Rank(1, 1, 0.4, 5, 2, 400000)])
    s = parse_engine_metrics(page, "sglang", 1.0)
    assert s.kv_usage == pytest.approx(0.3)
    assert (s.running, s.waiting, s.max_tokens, s.engines) == (8.0, 3.0, 800000, 2)
    # Only rank 0 of each group exporting (the default) reads the same.
    default = parse_engine_metrics(
        sglang_page([Rank(0, 0, 0.2, 3, 1, 400000), Rank(1, 0, 0.4, 5, 2, 400000)]), "sglang", 1.0)
    assert default == s
    # Usage is the share of the whole backend's tokens in use: weighted by each group's pool.
    uneven = parse_engine_metrics(
        sglang_page([Rank(0, 0, 0.2, 3, 1, 100000), Rank(1, 0, 0.4, 5, 2, 300000)]), "sglang", 1.0)
    assert uneven.kv_usage == pytest.approx((0.2 * 100000 + 0.4 * 300000) / 400000)


# --- admission ---------------------------------------------------------------------------------

POLICY = """
models:
  - {name: m, architecture: llama-3-8b}
pools:
  v16:
    models: [m]
    max_model_len: 8192
    block_size: 16
    backends: [{name: a, url: "http://127.0.0.1:1"}]
  v32:
    models: [m]
    max_model_len: 8192
    block_size: 32
    backends: [{name: b, url: "http://127.0.0.1:2"}]
  sg:
    engine: sglang
    models: [m]
    max_model_len: 8192
    block_size: 16
    backends: [{name: c, url: "http://127.0.0.1:3"}]
  lc:
    engine: llamacpp
    models: [m]
    max_model_len: 2048
    backends: [{name: d, url: "http://127.0.0.1:4"}]
"""


def admission() -> Admission:
    policy = parse_policy(POLICY)
    metrics = GatewayMetrics()
    clock = lambda: 1.0  # noqa: E731
    return Admission(policy, Backends(policy, metrics, clock), MemoryState(clock), metrics,
                     EngineScraper(5, clock), clock)


def test_capacity_reads_the_engine_report_in_the_pools_blocks() -> None:
    adm = admission()
    v16, v32, sg = adm.pools["v16"], adm.pools["v32"], adm.pools["sg"]
    dp2 = parse_engine_metrics(VLLM_DP2, "vllm", 1.0)
    adm.on_engine_sample("v16", "a", dp2)
    assert v16.capacity["a"] == 54000  # both engines' 16-token blocks, once
    adm.on_engine_sample("v32", "b", dp2)
    assert v32.capacity["b"] == 27000  # 54000 x 16 tokens in the pool's 32-token blocks
    adm.on_engine_sample("v16", "a", parse_engine_metrics(vllm_hybrid(2), "vllm", 1.0))
    assert v16.capacity["a"] == 655360 // 16  # kv_cache_size_tokens, not 1112 x 544 tokens
    page = sglang_page([Rank(None, 0, 0.31, 5, 2, 400000), Rank(None, 1, 0.31, 5, 2, 400000)])
    adm.on_engine_sample("sg", "c", parse_engine_metrics(page, "sglang", 1.0))
    assert sg.capacity["c"] == 25000  # one TP group's 400000 tokens


def test_admission_limit_uses_the_combined_usage() -> None:
    adm = admission()
    ps = adm.pools["v16"]
    sample = parse_engine_metrics(VLLM_DP2, "vllm", 1.0)
    adm.on_engine_sample("v16", "a", sample)
    adm.scraper.samples[("v16", "a")] = sample
    kv_max = ps.thresholds.kv_usage_max.value or 1.0
    # 65% of 54000 blocks are held by traffic we did not reserve; summed (1.3) left nothing.
    assert adm.max_blocks(ps, "a") == pytest.approx(54000 * (kv_max - 0.65), abs=1)
    assert adm.capacity.engine_full(ps, "a") is None


# llama.cpp's server --metrics, as server_task_result_metrics::to_metrics writes it
# (tools/server/server-task.cpp): counters, then gauges, no labels, values as C++ streams them.
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 0
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 567
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 1.25
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 415.2
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 2.75
"""


def test_llamacpp_page_and_props() -> None:
    s = parse_engine_metrics(LLAMACPP, "llamacpp", 1.0, (4, 2048))
    assert (s.running, s.waiting, s.busy_slots_per_decode) == (3, 2, 2.75)
    assert (s.prompt_tokens_total, s.predicted_tokens_total) == (1234, 567)
    assert (s.slots, s.slot_tokens, s.max_tokens, s.kv_usage) == (4, 2048, 8192, None)
    # Without /props the load is known and the capacity is not.
    bare = parse_engine_metrics(LLAMACPP, "llamacpp", 1.0)
    assert bare.running == 3 and bare.slots is None and bare.max_tokens is None


@pytest.mark.parametrize("text, expected", [
    ('{"total_slots": 4, "default_generation_settings": {"n_ctx": 2048}}', (4, 2048)),
    ('{"total_slots": 0, "default_generation_settings": {"n_ctx": 2048}}', None),
    ('{"total_slots": 4}', None),
    ('{"total_slots": true, "default_generation_settings": {"n_ctx": 2048}}', None),
    ('{"total_slots": 4, "default_generation_settings": {"n_ctx": "2048"}}', None),
    ("[1, 2]", None),
    ("not json", None),
])
def test_llamacpp_props_are_read_or_unknown(text: str, expected: tuple[int, int] | None) -> None:
    assert parse_llamacpp_props(text) == expected


@pytest.mark.anyio
async def test_a_slot_engine_takes_one_request_per_slot() -> None:
    adm = admission()
    ps = adm.pools["lc"]
    sample = parse_engine_metrics(LLAMACPP, "llamacpp", 1.0, (4, 2048))
    adm.on_engine_sample("lc", "d", sample)
    adm.scraper.samples[("lc", "d")] = sample
    # Four slots of 2048 tokens: 128 blocks of 16 each, and all of them (no KV fraction).
    assert ps.slot_blocks["d"] == 128 and ps.capacity["d"] == 512
    assert adm.max_blocks(ps, "d") == 512
    # A two-block request takes a whole slot: four run, the fifth finds none.
    held = [await adm.admit(Ask("lc", 2, 20)) for _ in range(4)]
    assert [t.lease.blocks for t in held if t.lease] == [128] * 4
    with pytest.raises(Overloaded) as err:
        await adm.admit(Ask("lc", 2, 20, deadline_s=0.0))
    assert err.value.reason == "kv_blocks"
    for t in held:
        await adm.release(t)
    assert ps.reserved["d"] == 0
