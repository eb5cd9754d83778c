"""The simulated engine's core without a server: scheduler, KV cache, step time, ledger.

Plain code on a virtual clock, so each test runs in milliseconds and asserts exact behaviour.
"""

from __future__ import annotations

import pytest

from gateway.cost.profiles import get_gpu, get_model, ledger, vllm_batch_defaults
from loadtest.sim import prompts
from loadtest.sim.config import ConfigError, SimConfig
from loadtest.sim.engine import EngineCore
from loadtest.sim.replay import WorkItem, replay
from loadtest.sim.scheduler import SimRequest, Status
from loadtest.sim.steptime import StepTimeModel


def request(n: int, prompt: int, output: int, hashes: list[int] | None = None) -> SimRequest:
    return SimRequest(f"r{n}", prompt, output, output, arrival_time=0.0,
                      prompt_hashes=hashes or [], salt=n)


def run_to_end(core: EngineCore, limit: int = 100_000) -> float:
    now = 0.0
    for _ in range(limit):
        step = core.begin_step(now)
        if step is None:
            return now
        now += step.duration_s
        core.finish_step(step, now)
    raise AssertionError("engine did not drain")


def test_ledger_matches_the_design_documents() -> None:
    model = get_model("generic-70b-gqa")
    assert model.kv_bytes_per_token("bf16") == 327_680
    mem = ledger(model, get_gpu("h100-sxm-80gb"), tp=8)
    assert mem.weights_per_gpu == pytest.approx(17.5e9)
    assert mem.kv_bytes_per_token_per_gpu == 327_680 // 8


def test_defaults_are_vllms_for_the_gpu() -> None:
    assert vllm_batch_defaults(get_gpu("h100-sxm-80gb")) == (8192, 1024)
    assert vllm_batch_defaults(get_gpu("h200-141gb")) == (8192, 1024)
    assert vllm_batch_defaults(get_gpu("a100-sxm-80gb")) == (2048, 256)
    spec = SimConfig(model="llama-3-70b", gpu="h100-sxm-80gb", tp=8).resolve()
    assert (spec.max_num_batched_tokens, spec.max_num_seqs, spec.block_size) == (8192, 1024, 16)
    # 80 GB x 0.9, minus 17.6 GB of weights and ~3 GB of activations, leaves ~56 GB a GPU
    # for 40 KiB of KV a token a GPU: ~1.4M tokens.
    assert 80_000 < spec.num_gpu_blocks < 95_000
    assert spec.max_model_len == 8192


def test_bad_configuration_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--max-model-len"):
        SimConfig(num_gpu_blocks=8, max_model_len=4096).resolve()
    with pytest.raises(ConfigError, match="no memory left for the KV cache"):
        SimConfig(model="llama-3-70b", gpu="a100-sxm-80gb", tp=1).resolve()
    with pytest.raises(ConfigError, match="gpu"):
        SimConfig(gpu="tpu-v9").resolve()


def test_step_time_is_memory_bound_for_decode_and_compute_bound_for_prefill() -> None:
    model = StepTimeModel(get_model("llama-3-70b"), get_gpu("h100-sxm-80gb"), 8, "bf16", "bf16")
    one = model.decode_step_s(1, 500)
    many = model.decode_step_s(32, 500)
    assert 0.008 < one < 0.016  # weights (17.6 GB / GPU) over HBM, plus all-reduce and overhead
    assert many < 1.3 * one  # batching decodes is almost free while weight-bound
    assert model.prefill_s(8000) > 5 * model.prefill_s(1000)  # compute grows with tokens
    # A mixed step costs less than a prefill step plus a decode step: the GEMMs are shared.
    mixed = model.step([(2000, 0)] + [(1, 500)] * 16).total_s
    assert mixed < model.prefill_s(2000) + model.decode_step_s(16, 500)


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_running() -> None:
    spec = SimConfig(num_gpu_blocks=4096, max_num_batched_tokens=1024, max_num_seqs=8).resolve()
    core = EngineCore(spec)
    short = request(1, 100, 50)
    core.add(short)
    step = core.begin_step(0.0)
    assert step is not None
    core.finish_step(step, 1.0)
    long = request(2, 3000, 5)
    core.add(long)
    budgets = []
    for now in range(2, 6):
        step = core.begin_step(float(now))
        assert step is not None
        sizes = {e.request.request_id: e.new_tokens for e in step.batch.entries}
        budgets.append(sizes)
        core.finish_step(step, float(now))
    assert budgets[0] == {"r1": 1, "r2": 1023}
    assert budgets[1] == {"r1": 1, "r2": 1023}
    assert budgets[2] == {"r1": 1, "r2": 954}  # the rest of the prompt, then its first token
    assert long.first_token_time == 4.0 and long.num_output_tokens == 2
    assert short.num_output_tokens == 5


def test_preemption_by_recompute_takes_the_newest_request_first() -> None:
    # 12 blocks of 16 tokens: three requests of 48 prompt tokens fit, their growth does not.
    spec = SimConfig(num_gpu_blocks=12, max_model_len=160, max_num_seqs=8).resolve()
    core = EngineCore(spec)
    reqs = [request(n, 48, 60) for n in range(3)]
    for r in reqs:
        core.add(r)
    preempted_first = None
    now = 0.0
    while core.has_work:
        step = core.begin_step(now)
        assert step is not None
        now += step.duration_s
        events = core.finish_step(step, now)
        if events.num_preempted and preempted_first is None:
            preempted_first = [r.request_id for r in reqs if r.num_preemptions]
    assert preempted_first == ["r2"]
    assert core.scheduler.num_preemptions >= 1
    assert all(r.status is Status.FINISHED and r.num_output_tokens == 60 for r in reqs)
    assert core.kv.pool.num_free == 12


def test_prefix_cache_reuses_blocks_of_shared_hash_ids() -> None:
    spec = SimConfig(num_gpu_blocks=1024).resolve()
    core = EngineCore(spec)
    shared = prompts.from_hash_ids([7, 8, 9], 512, 1500, 16)
    first = request(1, 1500, 2, shared)
    core.add(first)
    run_to_end(core)
    assert first.num_cached_tokens == 0
    # Same first two 512-token hash blocks, different third: 1024 tokens hit.
    second = request(2, 1500, 2, prompts.from_hash_ids([7, 8, 10], 512, 1500, 16))
    core.add(second)
    run_to_end(core)
    assert second.num_cached_tokens == 1024
    assert core.kv.hit_tokens == 1024


def test_prefix_cache_hit_shortens_time_to_first_token() -> None:
    spec = SimConfig(num_gpu_blocks=4096).resolve()
    hashes = tuple(prompts.from_hash_ids(list(range(8)), 512, 4096, 16))
    cold = replay(spec, arrivals=[(0.0, WorkItem(4096, 4))])
    warm = replay(spec, arrivals=[(0.0, WorkItem(4096, 4, hashes)),
                                  (1.0, WorkItem(4096, 4, hashes))])
    assert warm.traces[1].ttft < 0.3 * cold.traces[0].ttft


def test_message_hashes_share_the_common_leading_messages() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    a = prompts.from_messages([system, {"role": "user", "content": "first question"}], None,
                              400, 16)
    b = prompts.from_messages([system, {"role": "user", "content": "another one"}], None,
                              400, 16)
    shared = sum(1 for x, y in zip(a, b, strict=True) if x == y)
    assert 10 <= shared < len(a)  # the system prompt's blocks, not the user's
    assert prompts.from_token_ids(list(range(40)), 16) == prompts.from_token_ids(
        list(range(32)) + [99] * 8, 16)


def test_abort_frees_blocks_at_the_next_step() -> None:
    spec = SimConfig(num_gpu_blocks=64, max_model_len=512).resolve()
    core = EngineCore(spec)
    a, b = request(1, 200, 100), request(2, 200, 100)
    core.add(a)
    core.add(b)
    step = core.begin_step(0.0)
    assert step is not None
    core.abort(a)
    core.finish_step(step, 1.0)
    assert a.status is Status.ABORTED and b.num_output_tokens == 1
    run_to_end(core)
    assert core.kv.pool.num_free == 64 and b.num_output_tokens == 100


def test_frontend_latency_delays_entry_into_the_engine_not_the_steps() -> None:
    spec = SimConfig().resolve()
    bare = replay(spec, arrivals=[(0.0, WorkItem(200, 8))], frontend_s=0.0)
    fronted = replay(spec, arrivals=[(0.0, WorkItem(200, 8))], frontend_s=0.012)
    assert fronted.traces[0].ttft == pytest.approx(bare.traces[0].ttft + 0.012)
    assert fronted.traces[0].tpot == pytest.approx(bare.traces[0].tpot)
