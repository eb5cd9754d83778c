"""The per-request cost model: KV bytes and blocks, output lengths, work."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.cost import OutputLengthModel, RequestCostError, estimate
from gateway.cost.profiles import get_model

M70 = get_model("generic-70b-gqa")


def test_kv_bytes_per_token_and_per_gpu_share() -> None:
    cost = estimate(2500, 500, M70, block_size=16, tp=8)
    assert cost.kv_bytes_per_token == 327_680  # 2 x 80 x 8 x 128 x 2
    assert cost.kv_bytes_per_token_per_gpu == 40_960  # 8 KV heads over 8 ranks
    # TP beyond the KV heads replicates them: each of 16 ranks still holds one head.
    assert estimate(10, 1, M70, tp=16).kv_bytes_per_token_per_gpu == 40_960
    assert estimate(10, 1, M70, tp=1).kv_bytes_per_token_per_gpu == 327_680
    assert estimate(10, 1, M70, kv_dtype="fp8").kv_bytes_per_token == 163_840


def test_blocks_round_up_per_request() -> None:
    cost = estimate(2500, 500, M70, block_size=16, tp=8, expected_output=100)
    assert cost.kv_blocks_prompt == 157  # ceil(2500 / 16)
    assert cost.kv_blocks_reserved == 163  # ceil(2600 / 16)
    assert cost.kv_blocks_max == 188  # ceil(3000 / 16)
    assert cost.kv_bytes_reserved_per_gpu == 163 * 16 * 40_960
    assert estimate(0, 1, M70).kv_blocks_prompt == 0


def test_max_tokens_default_and_context_cap() -> None:
    assert estimate(1000, None, M70, default_max_tokens=2048).max_output_tokens == 2048
    # Like vLLM, the output can't run past the context window.
    near_end = estimate(131_000, None, M70, default_max_tokens=2048)
    assert near_end.max_output_tokens == 72
    assert estimate(100, 50, M70, max_model_len=120).max_output_tokens == 20
    with pytest.raises(RequestCostError, match="the model's context is 131072 tokens") as info:
        estimate(131_072, 10, M70)
    assert info.value.param == "messages"
    with pytest.raises(RequestCostError, match="max_tokens: must be at least 1, got 0"):
        estimate(10, 0, M70)


def test_expected_output_from_learned_p90() -> None:
    lengths = OutputLengthModel(default=256, quantile=0.9, window=100, min_samples=10)
    assert lengths.expected() == 256  # no data yet: the policy default
    for n in range(1, 101):
        lengths.observe(n)
    assert lengths.expected() == 90
    for _ in range(100):
        lengths.observe(1000)  # traffic changed: the window forgets the old lengths
    assert lengths.expected() == 1000
    cost = estimate(100, 500, M70, expected_output=lengths)
    assert cost.expected_output_tokens == 500  # never more than the request's max
    assert estimate(100, 500, M70, expected_output=None).expected_output_tokens == 500
    with pytest.raises(ValueError, match="quantile"):
        OutputLengthModel(default=1, quantile=0)


def test_prefill_and_decode_work() -> None:
    cost = estimate(1000, 10, M70, expected_output=10)
    assert cost.prefill_tokens == 1000
    assert cost.prefill_flops == pytest.approx(M70.prefill_flops(1000))
    assert cost.prefill_flops > 2 * 70e9 * 1000  # dense matmuls plus attention
    # Decode step i attends to 1000 + i earlier tokens.
    by_step = sum(M70.prefill_flops(1, context=1000 + i) for i in range(10))
    assert cost.decode_flops == pytest.approx(by_step)
    assert cost.decode_kv_read_bytes == 327_680 * sum(1000 + i for i in range(10))


def test_cost_is_a_record_and_serialisable() -> None:
    cost = estimate(10, 5, M70)
    # Immutable to the type checker (`make typecheck` refuses an assignment), plain at run time.
    params = type(cost).__dataclass_params__  # type: ignore[attr-defined]
    assert params.unsafe_hash and not params.frozen and not hasattr(cost, "__dict__")
    assert dataclasses.replace(cost, prompt_tokens=11).prompt_tokens == 11
    as_dict = cost.to_dict()
    assert as_dict["kv_blocks_max"] == 1 and as_dict["kv_bytes_max_per_gpu"] == 16 * 327_680


def test_a_cost_model_gives_the_profiles_figures_exactly() -> None:
    """The request path's CostModel works the profile's figures out once; every figure of
    its cost is the one ModelProfile's own formulas give, to the last bit."""
    from gateway.cost import CostModel
    from gateway.cost.profiles import MODELS, blocks_for

    learned = OutputLengthModel(300, min_samples=1)
    learned.observe(40)
    for profile in MODELS.values():
        for tp, block, dtype in ((1, 16, "bf16"), (8, 32, "fp8"), (16, 16, "bf16")):
            for expected in (None, 7, learned):
                model = CostModel(profile, block, tp, 512, expected, dtype, 8192)
                for prompt in (0, 1, 15, 16, 1000, 8000):
                    for max_tokens in (None, 1, 64, 9000):
                        cost = model.cost(prompt, max_tokens)
                        assert cost == estimate(prompt, max_tokens, profile, block, tp, 512,
                                                expected, dtype, 8192)
                        out = cost.expected_output_tokens
                        assert cost.prefill_flops == (
                            profile.prefill_flops(prompt) if prompt else 0.0)
                        assert cost.decode_flops == (
                            profile.prefill_flops(out, context=prompt) if out else 0.0)
                        assert cost.kv_bytes_per_token == profile.kv_bytes_per_token(dtype)
                        assert cost.kv_bytes_per_token_per_gpu == \
                            profile.kv_bytes_per_token_per_gpu(tp, dtype)
                        assert cost.kv_blocks_max == blocks_for(
                            prompt + cost.max_output_tokens, block)
