"""`gateway plan` prices tokens: hand arithmetic, the estimated split, goodput, bad price flags."""

from __future__ import annotations

import pytest

from gateway.cost.pricing import DECODE_EFFICIENCY, PREFILL_EFFICIENCY
from gateway.planner.throughput import STEP_OVERHEAD_S
from tests.test_plan import M70, TRACES, gateway_plan, plan_json

# Fixed lengths: P50 = P99 = 1,000 prompt tokens, 200 output tokens per request.
FIXED = ("--prompt-p50", "1000", "--prompt-p99", "1000", "--output-tokens", "200")


def test_stated_price_and_share_reproduce_hand_arithmetic() -> None:
    r = plan_json(*M70, *FIXED, "--rate", "2", "--gpu-hour", "2.50", "--input-share", "0.3")
    assert r["lengths"]["mean_prompt"] == 1000 and r["lengths"]["mean_output"] == 200
    assert [lay["tp"] for lay in r["layouts"]] == [8, 4]
    for lay in r["layouts"]:
        t, cost = lay["throughput"], lay["cost"]
        # 2 req/s x 1,000 = 2,000 input tokens/s, x 200 = 400 output tokens/s, on either layout.
        assert (t["input_tokens_s"], t["output_tokens_s"]) == (2000, 400)
        assert cost["per_hour"] == 20.0  # 8 GPUs x 2.50
        assert cost["input_share"] == 0.3 and cost["input_share_source"] == "from --input-share"
        assert cost["per_million_input"] == pytest.approx(20 / 3600 * 0.3 / 2000 * 1e6)  # 0.833
        assert cost["per_million_output"] == pytest.approx(20 / 3600 * 0.7 / 400 * 1e6)  # 9.722
        assert cost["per_million"] == pytest.approx(20 / 3600 / 2400 * 1e6)  # 2.315
        assert cost["holds"] is True and cost["note"] == ""
        assert cost["p_meets"] is None and cost["per_million_goodput"] is None  # no trace
    text = gateway_plan(*M70, *FIXED, "--rate", "2", "--gpu-hour", "2.50", "--input-share", "0.3")
    assert text.returncode == 0, text.stderr
    assert "cost (USD): 8 GPUs x 2.50 per GPU-hour = 20.00 per hour" in text.stdout
    assert "  load: 2 req/s (--rate), mean prompt 1,000 + output 200 tokens" in text.stdout
    row = next(line for line in text.stdout.splitlines() if line.startswith("  TP=8  x 1 ")
               and "0.833" in line)
    assert row.split()[-2:] == ["0.833", "9.722"]


def test_price_parts_are_summed_and_currency_labels() -> None:
    r = plan_json(*M70, *FIXED, "--rate", "2", "--currency", "EUR",
                  "--per-gpu-hour", "hardware=1.4,power=0.35,operations=0.75")
    assert r["cost_model"]["parts"] == [["hardware", 1.4], ["power", 0.35], ["operations", 0.75]]
    assert r["primary"]["cost"]["per_hour"] == pytest.approx(20.0)
    assert r["primary"]["cost"]["currency"] == "EUR"


def test_roofline_step_and_prefill_times_by_hand() -> None:
    # 64 concurrent requests on one TP=8 replica of H100s: every decode step reads 17.5 GB of
    # weights per GPU and 64 requests' KV at mean context 1,000 + 200 / 2 tokens x 40 KiB.
    r = plan_json(*M70, *FIXED, "--concurrency", "64", "--gpu-hour", "2.5")
    tp8 = r["layouts"][0]["throughput"]
    hbm = 3.35e12 * DECODE_EFFICIENCY
    step = STEP_OVERHEAD_S + (17.5e9 + 64 * 1100 * 40_960) / hbm
    assert tp8["mode"] == "concurrency"
    assert tp8["step_s"] == pytest.approx(step)
    flops = 2 * 70e9 * 1000 + 4 * 80 * 64 * 128 * (1000 * 1001 / 2)
    prefill = flops / (989.4e12 * 8 * PREFILL_EFFICIENCY)
    assert tp8["prefill_s"] == pytest.approx(prefill)
    # The replica is never idle at a stated concurrency: X x prefill + X x 200 x step / 64 = 1.
    per_s = 64 / (64 * prefill + 200 * step)
    assert tp8["output_tokens_s"] == pytest.approx(per_s * 200)


def test_estimated_share_makes_output_dearer_and_tp8_cheaper_at_equal_concurrency() -> None:
    r = plan_json(*M70, "--concurrency", "64", "--output-tokens", "500", "--gpu-hour", "2.5")
    tp8, tp4 = (lay["cost"] for lay in r["layouts"])
    for cost in (tp8, tp4):
        assert 0 < cost["input_share"] < 1
        assert cost["input_share_source"] == "estimated from prefill vs decode GPU time"
        assert cost["per_million_output"] > 5 * cost["per_million_input"]
    # One TP=8 replica reads the weights once per step for all 64 requests; two TP=4 replicas
    # read twice as many weight bytes per GPU for 32 each: fewer tokens/s, dearer output.
    t8, t4 = (lay["throughput"] for lay in r["layouts"])
    assert t8["output_tokens_s"] > t4["output_tokens_s"]
    assert tp8["per_million_output"] < tp4["per_million_output"]
    # Prefill is compute-bound on either layout: the same price per input token.
    assert tp8["per_million_input"] == pytest.approx(tp4["per_million_input"])


def test_layout_that_cannot_hold_the_load_says_why() -> None:
    # 400 requests of 2,548 tokens: one TP=8 replica holds 544, a TP=4 replica 185 (200 each).
    r = plan_json(*M70, "--prompt-p50", "2048", "--prompt-p99", "2048", "--output-tokens", "500",
                  "--concurrency", "400", "--gpu-hour", "2.5")
    tp8, tp4 = (lay["cost"] for lay in r["layouts"])
    assert tp8["holds"] is True
    assert tp4["holds"] is False
    assert tp4["note"] == "needs 200 requests in KV per replica, holds 185 at the mean length"
    # 8 req/s of ~3K-token prompts keeps 8 H100s in prefill 89% of the time: decode cannot keep up.
    r = plan_json(*M70, "--rate", "8", "--output-tokens", "500", "--gpu-hour", "2.5")
    cost = r["primary"]["cost"]
    assert cost["note"] == "load beyond the roofline's throughput" and cost["holds"] is False
    assert cost["per_million_output"] is None  # no steady state to price
    assert r["concurrency"] is None  # no steady state, so no concurrency to derive


def test_rate_alone_derives_concurrency_from_the_roofline() -> None:
    r = plan_json(*M70, *FIXED, "--rate", "2")
    assert r["concurrency_source"] == "roofline"
    t = r["primary"]["throughput"]
    # Little's law on the roofline: requests in flight = rate x (prefill + 200 x TPOT).
    assert t["concurrency_per_replica"] == pytest.approx(2 * (t["prefill_s"] + 200 * t["tpot_s"]))
    assert r["concurrency"] == -(-t["concurrency_per_replica"] // 1)
    assert r["primary"]["cost"] is None  # no price, no money


def test_trace_goodput_charges_preempted_requests_to_the_rest() -> None:
    r = plan_json(*M70, "--concurrency", "64", "--trace",
                  str(TRACES / "mooncake_conversation.jsonl.xz"), "--samples", "400", "--seed", "7",
                  "--gpu-hour", "2.5")
    tp8, tp4 = r["layouts"]
    assert r["lengths"]["source"] == "trace means"
    assert tp4["preempted_share"] > 0 and tp4["overflow_probability"] > tp4["preempted_share"]
    for lay in (tp8, tp4):
        cost = lay["cost"]
        assert cost["p_meets"] == pytest.approx(1 - lay["preempted_share"])
        assert cost["per_million_goodput"] == pytest.approx(cost["per_million"] / cost["p_meets"])
        assert cost["per_million_goodput_output"] == pytest.approx(
            cost["per_million_output"] / cost["p_meets"])
    assert tp8["cost"]["p_meets"] > tp4["cost"]["p_meets"]
    assert tp8["cost"]["per_million_goodput"] < tp4["cost"]["per_million_goodput"]


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-hour", "-1"], "--gpu-hour: must be a price per GPU-hour >= 0, got -1"),
    (["--gpu-hour", "nan"], "--gpu-hour: must be a price per GPU-hour >= 0, got nan"),
    (["--per-gpu-hour", "hardware"], "--per-gpu-hour: expected NAME=PRICE[,NAME=PRICE...] with "
                                     "prices per GPU-hour >= 0, got 'hardware'"),
    (["--per-gpu-hour", "hardware=1.4,power=abc"], "--per-gpu-hour: expected NAME=PRICE"),
    (["--per-gpu-hour", "hardware=1.4,power=-0.35"],
     "--per-gpu-hour: power must not be negative, got -0.35"),
    (["--per-gpu-hour", "power=1,power=2"], "--per-gpu-hour: power is given twice"),
    (["--gpu-hour", "2.5", "--input-share", "1.5"],
     "--input-share: must be between 0 and 1, got 1.5"),
    (["--input-share", "0.3"], "--input-share: give a price with it (--gpu-hour or "
                               "--per-gpu-hour)"),
    (["--gpu-hour", "2.5", "--currency", ""], "--currency: must be 1 to 8 characters, got ''"),
    (["--rate", "-1"], "rate: must be a non-negative number of arrivals/s, got -1.0"),
])
def test_bad_price_flags_name_the_flag_and_the_rule(args: list[str], message: str) -> None:
    done = gateway_plan(*M70, *args)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"gateway plan: {message}")


def test_one_price_only() -> None:
    done = gateway_plan(*M70, "--gpu-hour", "2.5", "--per-gpu-hour", "power=1")
    assert done.returncode == 2
    assert "argument --per-gpu-hour: not allowed with argument --gpu-hour" in done.stderr
