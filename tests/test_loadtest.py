"""`loadtest run | sweep | calibrate` against the simulated engine and the gateway on loopback.

Runs are short (seconds) and the engines small (a few hundred KV blocks), so saturation, and
with it a knee, is reached at a few requests per second.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import (
    bearer,
    free_port,
    gateway_cmd,
    http,
    loadtest_cmd,
    metric,
    run_server,
    scrape,
)

ADMIN = "sk-calibrate-admin"
SLO = "ttft=500ms,tpot=50ms"
LOAD = ("--synthetic", "in=512,out=64", "--no-progress")


def loadtest(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(loadtest_cmd(*args), capture_output=True, text=True, timeout=timeout)


def test_run_reports_vllm_figures_with_sane_values(start_sim: StartSim, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with start_sim() as sim:
        done = loadtest("run", "--url", sim.url, *LOAD, "--rate", "6", "--duration", "2",
                        "--slo", SLO, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Median TTFT (ms):" in done.stdout
    r = json.loads(out.read_text())
    for key in ("completed", "request_throughput", "request_goodput", "output_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
                "p99_e2el_ms", "p90_ttft_ms", "p95_ttft_ms", "input_throughput",
                "slo_attainment_pct", "rejection_rate_pct", "error_rate_pct", "noise"):
        assert key in r, key
    assert r["completed"] >= 8 and r["errors"] == 0 and r["rejected"] == 0
    assert r["total_input_tokens"] == 512 * r["completed"]  # exact prompts, by the engine's count
    assert r["total_output_tokens"] == 64 * r["completed"]  # forced output lengths
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"]
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["request_goodput"] <= r["request_throughput"]
    assert r["generator"]["cpu_fraction"] < 0.8 and r["generator"]["chunks"] > 0
    assert r["load"]["shape"] == "6 req/s poisson"


def test_repeated_url_spreads_the_load_over_every_engine(start_sim: StartSim,
                                                          tmp_path: Path) -> None:
    # A benchmark "direct to two engines" must reach both, not only the last one named.
    out = tmp_path / "two.json"
    with start_sim() as a, start_sim() as b:
        done = loadtest("run", "--url", a.url, "--url", b.url, *LOAD, "--concurrency", "2",
                        "--max-requests", "8", "--out", str(out))
        served = [metric(scrape(sim.url), "vllm:request_success_total") for sim in (a, b)]
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["completed"] == 8
    assert sum(served) == 8 and min(served) >= 2, served


def test_plot_of_a_run(start_sim: StartSim, tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    with start_sim() as sim:
        done = loadtest("run", "--url", sim.url, *LOAD, "--concurrency", "2", "--max-requests",
                        "6", "--plot", str(png))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_through_the_gateway_rejections_are_counted_not_errors(
        start_sim: StartSim, start_gateway: StartGateway, tmp_path: Path) -> None:
    out = tmp_path / "gw.json"
    # 80 blocks x 90%: two 36-block requests at a time; a short queue, then 503s.
    pool = ("    kv_blocks: 80\n    admission:\n      queue_size: 2\n"
            "      queue_wait_max_s: 5\n")
    with start_sim("--num-gpu-blocks", "80") as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=pool)) as gw:
        done = loadtest("run", "--url", gw.url, *LOAD, "--concurrency", "8", "--duration", "3",
                        "--slo", SLO, "--out", str(out))
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["rejected"] > 0 and r["errors"] == 0 and r["completed"] > 0
    assert r["retry_after_median_s"] is not None and r["retry_after_median_s"] > 0
    assert r["median_queue_ms"] is not None  # the gateway's x-gateway-queue-ms, when it queued
    assert r["slo_attainment_pct"] < 100 and r["rejection_rate_pct"] > 0


def test_each_bad_input_gets_its_message(start_sim: StartSim, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    done = loadtest("run", "--url", dead, *LOAD, "--rate", "1", "--duration", "1")
    assert done.returncode == 1
    assert done.stderr.startswith(f"loadtest: error: cannot reach {dead}: ")
    assert "(is the engine or gateway running, and is the URL right?)" in done.stderr

    trace = tmp_path / "bad.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,lots,8\n")
    done = loadtest("run", "--url", dead, "--trace", str(trace), "--no-progress")
    assert done.returncode == 2
    assert done.stderr == (f"loadtest: error: {trace}:3: ContextTokens must be a non-negative "
                           "integer, got 'lots'\n")

    done = loadtest("run", "--url", dead, *LOAD, "--rate", "1", "--slo", "ttft=2")
    assert done.returncode == 2
    assert done.stderr == ("loadtest: error: --slo ttft: '2' is not a duration; write it with a "
                           "unit, like 2s or 60ms\n")

    done = loadtest("run", "--url", dead, *LOAD)
    assert done.returncode == 2
    assert "give --rate R (open loop), --concurrency C (closed loop)" in done.stderr

    done = loadtest("sweep", "--url", dead, *LOAD, "--rates", "1,x")
    assert done.returncode == 2
    assert "--rates '1,x': expected positive numbers like 1,2,4,8, or auto" in done.stderr

    with start_sim() as sim:
        done = loadtest("run", "--url", sim.url, "--model", "llama-9000", *LOAD, "--rate", "1")
    assert done.returncode == 1
    assert done.stderr == (f"loadtest: error: model 'llama-9000' is not served by {sim.url}; "
                           "it serves: test-model\n")


def _knee(done: subprocess.CompletedProcess[str], out: Path) -> float | None:
    assert done.returncode == 0, done.stderr
    knee = json.loads(out.read_text())["sweep"]["knee_rate"]
    return None if knee is None else float(knee)


def test_sweep_knee_moves_when_engine_capacity_halves(start_sim: StartSim,
                                                      tmp_path: Path) -> None:
    # 360 blocks hold ten 576-token requests at once, 180 hold five: half the capacity.
    sweep = ("sweep", *LOAD, "--rates", "2.5,5,10", "--arrival", "constant", "--duration",
             "2.5", "--slo", SLO, "--target-attainment", "90", "--pause", "0.2",
             "--gpu-hour", "2.5", "--gpus", "1")
    with start_sim("--num-gpu-blocks", "360") as full, \
            start_sim("--num-gpu-blocks", "180") as half:
        outs = [tmp_path / "full.json", tmp_path / "half.json"]
        procs = [subprocess.Popen(loadtest_cmd(*sweep, "--url", sim.url, "--out", str(out)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for sim, out in ((full, outs[0]), (half, outs[1]))]
        results = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=90)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    knee_full, knee_half = _knee(results[0], outs[0]), _knee(results[1], outs[1])
    assert knee_full is not None and knee_half is not None, results[1].stdout
    assert knee_half < knee_full, (results[0].stdout, results[1].stdout)
    assert "knee: " in results[0].stdout
    half_sweep = json.loads(outs[1].read_text())
    steps = half_sweep["steps"]
    assert [s["offered"] for s in steps] == [2.5, 5.0, 10.0]
    assert steps[-1]["report"]["slo_attainment_pct"] < 90
    # Throughput stops following the offer: the half engine serves (first tokens) well under
    # 10 req/s at that step, and the sweep names the most it served as its saturation rate.
    full_sweep = json.loads(outs[0].read_text())
    assert half_sweep["sweep"]["saturated"] is True
    assert half_sweep["sweep"]["saturation_rate"] == max(
        min(s["report"]["served_rate"], s["offered"]) for s in steps
        if s["report"]["served_rate"] is not None)  # 6 sends at 2.5 req/s: too few to say
    assert half_sweep["sweep"]["saturation_rate"] < full_sweep["sweep"]["saturation_rate"]
    assert "saturation: " in results[1].stdout
    # Priced: every step carries its cost, and the cheapest load is the passing step (at or
    # below the knee) with the lowest cost per million goodput tokens.
    passing = [s for s in steps if s["offered"] <= knee_half]
    best = min(passing, key=lambda s: s["report"]["cost_per_million_goodput_tokens"])
    assert half_sweep["sweep"]["cheapest_rate"] == best["offered"]
    assert half_sweep["sweep"]["cheapest_cost_per_million_goodput_tokens"] == \
        best["report"]["cost_per_million_goodput_tokens"]
    assert f"cheapest: {best['offered']:g} req/s at " in results[1].stdout


def test_calibrate_writes_a_learned_block_the_gateway_enforces_after_reload(
        start_sim: StartSim, tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    with start_sim("--num-gpu-blocks", "180") as sim:
        policy.write_text("# the SRE's own comment\n" + policy_yaml(
            [sim.url], pool_extra="    admission:\n      queue_size: 0   # reject, never wait\n"))
        before = policy.read_text()
        calibrate = ("calibrate", "--policy", str(policy), "--pool", "default", *LOAD,
                     "--arrival", "constant", "--slo", SLO, "--target-attainment", "90",
                     "--pause", "0.2")
        dry = loadtest(*calibrate, "--rates", "2.5", "--duration", "1.5")
        assert dry.returncode == 0, dry.stderr
        assert policy.read_text() == before  # without --write nothing changes
        assert "+      learned:" in dry.stdout and "dry run: nothing written" in dry.stderr

        with run_server(gateway_cmd("serve", "--policy", str(policy), "--port", "{port}"),
                        "/healthz", tmp_path, "gateway",
                        env={"GATEWAY_ADMIN_KEY": ADMIN}) as gw:
            reply = http("GET", gw.url + "/admin/state", headers=bearer(ADMIN))
            assert reply.status == 200
            state = reply.json()
            # Before calibration the planner's limits hold (model, GPU, TP and the default SLO).
            assert state["pools"]["default"]["thresholds"]["inflight_tokens_max"]["source"] == \
                "planner"
            done = loadtest(*calibrate, "--rates", "2.5,5,10", "--duration", "2.5", "--write")
            assert done.returncode == 0, done.stderr
            text = policy.read_text()
            assert text.startswith("# the SRE's own comment\n")
            assert "queue_size: 0   # reject, never wait" in text
            # Provenance says where throughput stopped following the offer, for planners.
            assert "saturation_rate_rps:" in text and "saturation_reached:" in text
            check = subprocess.run(gateway_cmd("check", str(policy)), capture_output=True,
                                   text=True, timeout=30)
            assert check.returncode == 0, check.stderr

            assert http("POST", gw.url + "/admin/reload", headers=bearer(ADMIN)).status == 200
            state = http("GET", gw.url + "/admin/state", headers=bearer(ADMIN)).json()
            thresholds = state["pools"]["default"]["thresholds"]
            assert thresholds["kv_usage_max"]["source"] == "learned"
            assert thresholds["inflight_tokens_max"]["source"] == "learned"
            assert thresholds["ttft_p99_max_s"]["source"] == "learned"
            assert thresholds["tpot_p99_max_s"]["source"] == "learned"
            learned_tokens = thresholds["inflight_tokens_max"]["value"]
            # The knee held a handful of 576-token requests; less the margin, it is fewer.
            assert 576 <= learned_tokens < 180 * 16

            # Enforced: a load past the knee is turned away at the door rather than queued
            # inside the engine.
            out = tmp_path / "after.json"
            run = loadtest("run", "--url", gw.url, *LOAD, "--concurrency", "10", "--duration",
                           "2", "--out", str(out))
            assert run.returncode == 0, run.stderr
            after = json.loads(out.read_text())
            assert after["rejected"] > 0 and after["completed"] > 0 and after["errors"] == 0


def test_requests_still_running_after_the_drain_are_cancelled_and_counted(
        start_sim: StartSim, tmp_path: Path) -> None:
    out = tmp_path / "drain.json"
    with start_sim("--time-scale", "50") as sim:  # ~0.5 s a token: nothing ends in time
        done = loadtest("run", "--url", sim.url, *LOAD, "--rate", "4", "--duration", "1",
                        "--drain", "0.5", "--out", str(out))
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["generator"]["cancelled_at_drain"] == r["sent"] == r["errors"] > 0
    assert r["completed"] == 0
    assert "requests were cancelled at the end of the run" in done.stderr
    assert any("cancelled: still running 0.5 s after the last send" in k
               for k in r["error_examples"])
