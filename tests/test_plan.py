"""`gateway plan` reproduces the design documents' ledger and rejects bad architectures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "traces"
GiB = 2**30
M70 = ["--model", "generic-70b-gqa", "--gpu", "h100-sxm-80gb"]


def gateway_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def plan_json(*args: str) -> dict[str, Any]:
    done = gateway_plan(*args, "--json")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_document_70b_tp8_ledger() -> None:
    # 8 x H100, 70B GQA BF16, 64 concurrent requests of 2,500 tokens (design doc, sections 2-3).
    r = plan_json(*M70, "--gpus", "8", "--tp", "8", "--concurrency", "64", "--avg-tokens", "2500",
                  "--prompt-p50", "2048", "--prompt-p99", "16384", "--output-tokens", "500")
    assert r["weights_bytes"] == 140e9
    assert r["primary"]["weights_per_gpu_bytes"] == 17.5e9
    assert r["kv_bytes_per_token"] == 327_680
    assert r["primary"]["kv_bytes_per_token_per_gpu"] == 40_960  # ~40 KiB per GPU
    avg = r["demand_avg"]
    assert avg["total_bytes"] == 64 * 2500 * 327_680
    assert round(avg["total_bytes"] / GiB, 1) == 48.8
    assert round(avg["per_gpu_bytes"] / GiB, 1) == 6.1
    # "64 requests near 16K prompts plus 500 output tokens: over 300 GiB, over 40 GiB a GPU"
    p99 = r["demand_p99"]
    assert p99["total_bytes"] / GiB > 300 and p99["per_gpu_bytes"] / GiB > 40
    layouts = {(lay["tp"], lay["replicas"]) for lay in r["layouts"]}
    assert layouts == {(8, 1), (4, 2)}
    tp4 = next(lay for lay in r["layouts"] if lay["tp"] == 4)
    assert tp4["weights_per_gpu_bytes"] == 35e9  # 140 GB / 4


def test_document_kv_budget_32gb_at_8192_tokens() -> None:
    # "32GB / (320KB x 8192) ~ 12": one card holding every KV head, a 32 GiB KV budget.
    r = plan_json(*M70, "--gpus", "1", "--tp", "1", "--kv-budget-gib", "32",
                  "--prompt-p50", "8192", "--prompt-p99", "8192")
    assert r["primary"]["kv_budget_explicit"] is True
    assert r["primary"]["max_concurrency_p50"] == 12
    assert r["primary"]["weights_fit"] is False  # 140 GB on one card: the doc states the budget


def test_document_kv_budget_40gb_at_2048_tokens() -> None:
    # "320KB x 2048 = 640MB; 40GB of KV cache holds about 64 concurrent requests".
    r = plan_json(*M70, "--gpus", "1", "--tp", "1", "--kv-budget-gib", "40",
                  "--prompt-p50", "2048", "--prompt-p99", "2048")
    assert r["primary"]["max_concurrency_p50"] == 64
    # The same 40 GiB on each GPU of a TP=4 replica: each rank holds 2 of the 8 KV heads.
    r4 = plan_json(*M70, "--gpus", "4", "--tp", "4", "--kv-budget-gib", "40",
                   "--prompt-p50", "2048", "--prompt-p99", "2048")
    assert r4["primary"]["kv_bytes_per_token_per_gpu"] == 81_920
    assert r4["primary"]["max_concurrency_p50"] == 256


def test_littles_law_concurrency_and_text_output() -> None:
    # "8 req/s x 6 s mean time in system ~ 48 active requests"
    r = plan_json(*M70, "--rate", "8", "--mean-latency", "6", "--avg-tokens", "2500")
    assert (r["concurrency"], r["concurrency_source"]) == (48, "little's law")
    text = gateway_plan(*M70, "--concurrency", "64", "--avg-tokens", "2500")
    assert text.returncode == 0, text.stderr
    assert "327,680 B (320 KiB) in all, 40,960 B (40 KiB) per GPU" in text.stdout
    assert "140.0 GB in all, 17.50 GB per GPU" in text.stdout
    assert "48.8 GiB in all, 6.1 GiB per GPU" in text.stdout


def test_trace_overflow_probability_is_seeded() -> None:
    args = (*M70, "--concurrency", "128", "--trace",
            str(TRACES / "mooncake_conversation.jsonl.xz"), "--samples", "400", "--seed", "7")
    first, second = plan_json(*args), plan_json(*args)
    assert first == second
    assert (first["prompt_p50"], first["prompt_p99"]) == (6909, 85_401)  # README: 6,909 and ~85,400
    probabilities = [lay["overflow_probability"] for lay in first["layouts"]]
    assert all(0.0 <= p <= 1.0 for p in probabilities)
    tp8, tp4 = first["layouts"]
    # Two TP=4 replicas each take half the requests but have under half the KV tokens.
    assert tp4["overflow_probability"] >= tp8["overflow_probability"]


@pytest.mark.parametrize(("args", "message"), [
    (["--layers", "0"], "architecture.num_layers: must be a positive integer, got 0"),
    (["--layers", "-80"], "architecture.num_layers: must be a positive integer, got -80"),
    (["--heads", "60"], "architecture.num_attention_heads: must be divisible by num_kv_heads "
                        "(GQA groups), got 60 and 8"),
    (["--kv-heads", "0"], "architecture.num_kv_heads: must be a positive integer, got 0"),
    (["--dtype", "fp6"], "dtype: unknown dtype 'fp6'; expected one of bf16, fp16, fp8, int8, int4"),
    (["--gpu", "h300"], "gpu: unknown GPU 'h300'; expected one of"),
    (["--tp", "3"], "gpus: must be a multiple of tp (3), got 8"),
    (["--gpu", "a100-sxm-80gb", "--dtype", "fp8"], "dtype: a100-sxm-80gb has no FP8 tensor cores"),
])
def test_bad_input_names_field_and_rule(args: list[str], message: str) -> None:
    done = gateway_plan(*M70, *args)
    assert done.returncode == 1
    assert done.stderr.startswith(f"gateway plan: {message}")
    assert done.stdout == ""


def test_architecture_from_flags_and_unknown_model() -> None:
    r = plan_json("--gpu", "h100-sxm-80gb", "--layers", "80", "--heads", "64", "--kv-heads", "8",
                  "--head-dim", "128", "--params", "70B")
    assert r["kv_bytes_per_token"] == 327_680 and r["weights_bytes"] == 140e9
    done = gateway_plan("--gpu", "h100-sxm-80gb", "--layers", "80")
    assert done.returncode == 1
    assert "model: give --model NAME or all of --heads, --kv-heads, --head-dim, --params" in (
        done.stderr)
    done = gateway_plan("--model", "gpt-5", "--gpu", "h100-sxm-80gb")
    assert done.returncode == 1
    assert done.stderr.startswith("gateway plan: model: unknown model profile 'gpt-5'")
