"""Cost per token in `loadtest run | sweep`: the price flags, the figures recomputed by hand, the
cheapest load of a sweep (docs/loadtest.md, Cost)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.cost.pricing import PriceError
from loadtest.client import RequestResult, Usage
from loadtest.pricing import Pricing, add_price_options, cost_figures, parse_pricing
from loadtest.report import Sample, figures, render_text
from loadtest.sweep import Sweep, cheapest_line, step_line
from tests.conftest import StartSim
from tests.servers import free_port, loadtest_cmd

REL = 1e-9


def loadtest(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(loadtest_cmd(*args), capture_output=True, text=True, timeout=timeout)


# --- the flags ----------------------------------------------------------------------------------


def _pricing(*argv: str) -> Pricing | None:
    p = argparse.ArgumentParser()
    add_price_options(p)
    return parse_pricing(p.parse_args(list(argv)))


def test_price_flags_parse_as_gateway_plans_do() -> None:
    assert _pricing() is None
    assert _pricing("--gpu-hour", "2.5", "--gpus", "8") == Pricing(8, 2.5)
    got = _pricing("--per-gpu-hour", "hardware=1.4,power=0.35,operations=0.75", "--gpus", "2",
                   "--currency", "EUR", "--input-share", "0.3")
    assert got is not None and got.per_gpu_hour == pytest.approx(2.5) and got.per_hour == \
        pytest.approx(5.0)
    assert got.parts == (("hardware", 1.4), ("power", 0.35), ("operations", 0.75))
    assert got.currency == "EUR" and got.input_share == 0.3


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu-hour", "-1", "--gpus", "1"],
     "--gpu-hour: must be a price per GPU-hour >= 0, got -1"),
    (["--gpu-hour", "nan", "--gpus", "1"],
     "--gpu-hour: must be a price per GPU-hour >= 0, got nan"),
    (["--per-gpu-hour", "hardware", "--gpus", "1"],
     "--per-gpu-hour: expected NAME=PRICE[,NAME=PRICE...] with prices per GPU-hour >= 0, got "
     "'hardware'"),
    (["--per-gpu-hour", "hardware=1.4,power=-0.35", "--gpus", "1"],
     "--per-gpu-hour: power must not be negative, got -0.35"),
    (["--per-gpu-hour", "power=1,power=2", "--gpus", "1"], "--per-gpu-hour: power is given twice"),
    (["--gpu-hour", "2.5", "--gpus", "1", "--input-share", "1.5"],
     "--input-share: must be between 0 and 1, got 1.5"),
    (["--input-share", "0.3"], "--input-share: give a price with it (--gpu-hour or "
                               "--per-gpu-hour)"),
    (["--gpu-hour", "2.5", "--gpus", "1", "--currency", ""],
     "--currency: must be 1 to 8 characters, got ''"),
    (["--gpus", "8"], "--gpus: give a price with it (--gpu-hour or --per-gpu-hour)"),
    (["--gpu-hour", "2.5"], "--gpus: give the number of GPUs behind the target with a price"),
    (["--gpu-hour", "2.5", "--gpus", "0"], "--gpus: must be a positive integer, got 0"),
])
def test_bad_price_flags_name_the_flag_and_the_rule(argv: list[str], message: str) -> None:
    with pytest.raises(PriceError) as err:
        _pricing(*argv)
    assert str(err.value).startswith(message)


def test_bad_price_is_refused_before_the_target_is_touched() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    load = ("--synthetic", "in=512,out=64", "--no-progress")
    done = loadtest("run", "--url", dead, *load, "--rate", "1", "--gpu-hour", "2.5")
    assert done.returncode == 2
    assert done.stderr.startswith("loadtest: error: --gpus: give the number of GPUs behind the "
                                  "target with a price")
    done = loadtest("sweep", "--url", dead, *load, "--slo", "ttft=1s", "--gpus", "1",
                    "--per-gpu-hour", "power=x")
    assert done.returncode == 2
    assert "loadtest: error: --per-gpu-hour: expected NAME=PRICE" in done.stderr


# --- the figures --------------------------------------------------------------------------------


def _result(ok: bool, ttft: float, prompt: int, out: int) -> RequestResult:
    gaps = [0.01] * (out - 1)
    return RequestResult(start_s=0.0, status=200 if ok else 503, ttft_s=ttft if ok else None,
                         e2e_s=ttft + 0.01 * (out - 1), events=out + 3, gaps_s=gaps if ok else [],
                         max_gap_s=0.01, usage=Usage(prompt, out, prompt + out) if ok else None,
                         error=None if ok else "busy", retry_after_s=None, queue_ms=None)


def _samples() -> list[Sample]:
    """Eight completed requests of 100 + 11 .. 100 + 18 tokens, the first four fast enough for
    the TTFT SLO, and one rejection."""
    out = [Sample(i, 100, 11 + i, _result(True, 0.1 if i < 4 else 2.0, 100, 11 + i))
           for i in range(8)]
    return [*out, Sample(8, 100, 11, _result(False, 0.0, 100, 11))]


def test_cost_figures_match_the_hand_computation() -> None:
    report = figures(_samples(), 12.0, {"ttft": 1.0})
    assert report["good"] == 4
    assert report["good_input_tokens"] == 400 and report["good_output_tokens"] == 11 + 12 + 13 + 14
    spend = 4 * 2.5 * 12.0 / 3600  # 4 GPUs x 2.50 an hour x 12 s
    inp, out = 800, sum(range(11, 19))
    good_in, good_out = 400, 50

    c = cost_figures(report, Pricing(4, 2.5))
    assert c["cost_total"] == pytest.approx(spend, rel=REL)
    assert c["cost_per_million_tokens"] == pytest.approx(spend / (inp + out) * 1e6, rel=REL)
    assert c["cost_per_million_output_tokens"] == pytest.approx(spend / out * 1e6, rel=REL)
    assert c["cost_per_million_goodput_tokens"] == pytest.approx(
        spend / (good_in + good_out) * 1e6, rel=REL)
    assert c["cost_per_million_goodput_output_tokens"] == pytest.approx(
        spend / good_out * 1e6, rel=REL)
    assert c["cost_per_million_input_tokens"] is None  # no split guessed without --input-share
    assert c["cost"] == {"currency": "USD", "gpus": 4, "per_gpu_hour": 2.5, "parts": {},
                         "per_hour": 10.0, "input_share": None}

    s = cost_figures(report, Pricing(4, 2.5, input_share=0.25))
    assert s["cost_per_million_tokens"] == c["cost_per_million_tokens"]  # blended: no share
    assert s["cost_per_million_input_tokens"] == pytest.approx(spend * 0.25 / inp * 1e6, rel=REL)
    assert s["cost_per_million_output_tokens"] == pytest.approx(spend * 0.75 / out * 1e6, rel=REL)
    assert s["cost_per_million_goodput_input_tokens"] == pytest.approx(
        spend * 0.25 / good_in * 1e6, rel=REL)
    assert s["cost_per_million_goodput_output_tokens"] == pytest.approx(
        spend * 0.75 / good_out * 1e6, rel=REL)

    text = render_text({**report, **s})
    assert "Cost (USD)" in text and "4 x 2.50" in text
    assert "Cost per million goodput input tokens:" in text

    no_slo = figures(_samples(), 12.0, {})
    n = cost_figures(no_slo, Pricing(4, 2.5))
    assert n["cost_per_million_goodput_tokens"] is None and n["cost_per_million_tokens"]
    assert "goodput" not in render_text({**no_slo, **n}).split("Cost (USD)")[1]


# --- the sweep's cheapest load ------------------------------------------------------------------


def _step(rate: float, attainment: float, cost: float | None) -> dict[str, Any]:
    report: dict[str, Any] = {"slo_attainment_pct": attainment, "sent": 10,
                              "request_throughput": rate, "request_goodput": rate,
                              "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "median_tpot_ms": 1.0,
                              "p99_tpot_ms": 2.0, "rejection_rate_pct": 0.0,
                              "error_rate_pct": 0.0}
    if cost is not None:
        report.update({"cost": {"currency": "USD"}, "cost_per_million_goodput_tokens": cost,
                       "cost_per_million_tokens": cost * 0.9})
    return {"offered": rate, "report": report}


def test_cheapest_is_the_lowest_cost_at_or_below_the_knee() -> None:
    sweep = Sweep(99.0, [_step(8, 99.5, 0.30), _step(1, 100, 1.20), _step(2, 100, 0.60),
                         _step(4, 99.0, 0.25), _step(16, 80, 0.20), _step(32, 99.9, 0.10)])
    # 32 passes and is cheapest, but past the failing 16: noise, as for the knee
    assert sweep.knee == 8
    best = sweep.cheapest_step()
    assert best is not None and best["offered"] == 4  # cheaper than the knee itself
    assert cheapest_line(sweep, "USD") == (
        "cheapest: 4 req/s at 0.250 USD per million goodput tokens (0.225 per million tokens, "
        "SLO attainment 99.0%)")
    assert step_line(best).endswith("       0.250")

    tie = Sweep(99.0, [_step(1, 100, 0.5), _step(2, 100, 0.5), _step(4, 50, 0.1)])
    best = tie.cheapest_step()
    assert best is not None and best["offered"] == 1  # a tie goes to the lower load

    assert Sweep(99.0, [_step(1, 90, 0.5), _step(2, 100, 0.2)]).cheapest_step() is None  # no knee
    unpriced = Sweep(99.0, [_step(1, 100, None), _step(2, 100, None)])
    assert unpriced.knee == 2 and unpriced.cheapest_step() is None
    assert cheapest_line(Sweep(99.0, [_step(1, 50, 0.5)]), "USD").startswith("cheapest: none")


def test_sweep_plot_marks_the_cheapest_load(tmp_path: Path) -> None:
    from loadtest.plot import plot_sweep

    steps = [_step(1, 100, 1.2), _step(2, 100, 0.6), _step(4, 99, 0.25), _step(8, 50, 0.4)]
    png = tmp_path / "sweep.png"
    plot_sweep(steps, 4, str(png), "t", cheapest=4, currency="USD")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- a small fixed run, recomputed by hand ------------------------------------------------------


def test_run_cost_recomputed_by_hand_from_its_own_report(start_sim: StartSim,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with start_sim() as sim:
        done = loadtest("run", "--url", sim.url, "--synthetic", "in=512,out=64", "--no-progress",
                        "--rate", "6", "--duration", "2", "--slo", "ttft=500ms,tpot=50ms",
                        "--per-gpu-hour", "hardware=1.4,power=0.35,operations=0.75",
                        "--gpus", "2", "--input-share", "0.25", "--out", str(out))
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["completed"] >= 8 and r["good"] is not None
    # The engine's own counts: 512 + 64 tokens a request, the good ones among them.
    assert r["total_input_tokens"] == 512 * r["completed"]
    assert r["good_input_tokens"] == 512 * r["good"] and r["good_output_tokens"] == 64 * r["good"]
    spend = 2 * (1.4 + 0.35 + 0.75) * r["duration"] / 3600
    inp, out_tokens = r["total_input_tokens"], r["total_output_tokens"]
    good = r["good_input_tokens"] + r["good_output_tokens"]
    assert r["cost"]["per_hour"] == pytest.approx(5.0, rel=REL)
    assert r["cost"]["parts"] == {"hardware": 1.4, "power": 0.35, "operations": 0.75}
    assert r["cost_total"] == pytest.approx(spend, rel=REL)
    assert r["cost_per_million_tokens"] == pytest.approx(spend / (inp + out_tokens) * 1e6, rel=REL)
    assert r["cost_per_million_input_tokens"] == pytest.approx(spend * 0.25 / inp * 1e6, rel=REL)
    assert r["cost_per_million_output_tokens"] == pytest.approx(
        spend * 0.75 / out_tokens * 1e6, rel=REL)
    assert r["cost_per_million_goodput_tokens"] == pytest.approx(spend / good * 1e6, rel=REL)
    assert r["cost_per_million_goodput_output_tokens"] == pytest.approx(
        spend * 0.75 / r["good_output_tokens"] * 1e6, rel=REL)
    assert "Cost (USD)" in done.stdout and "Cost per million goodput tokens:" in done.stdout
    assert f"{r['cost_per_million_goodput_tokens']:,.3f}" in done.stdout
