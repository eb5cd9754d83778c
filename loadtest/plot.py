"""PNG plots of a run (latencies over time) and of a sweep (percentiles and goodput vs load).

matplotlib is imported only here (and in loadtest/html_report.py) and only when a plot is asked
for: it takes ~0.5 s to import, which a run without plots need not pay, and it is in the
`loadtest` extra, not a dependency of the gateway (loadtest/extras.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.extras import require
from loadtest.report import Sample


def require_matplotlib(needed: str = "--plot and --report need matplotlib") -> Any:
    """The pyplot module with a file-only backend; MissingExtra (a RuntimeError) saying what to
    install if matplotlib is absent."""
    matplotlib = require("matplotlib", needed)
    matplotlib.use("Agg")  # no display here, and none wanted
    import matplotlib.pyplot as plt

    return plt


def plot_run(samples: Sequence[Sample], report: Mapping[str, Any], path: str) -> None:
    plt = require_matplotlib()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ok = [s for s in samples if s.kind == "ok" and s.result.ttft_s is not None]
    starts = [s.result.start_s for s in ok]
    top.scatter(starts, [s.result.ttft_s * 1000 for s in ok if s.result.ttft_s is not None],
                s=6, label="TTFT")
    top.scatter(starts, [s.result.e2e_s * 1000 for s in ok], s=6, label="E2E", alpha=0.5)
    top.set_ylabel("ms")
    top.set_yscale("log")
    top.legend(loc="upper left")
    tpots = [(s.result.start_s, t * 1000) for s in ok if (t := s.tpot_s) is not None]
    bottom.scatter([a for a, _ in tpots], [b for _, b in tpots], s=6, color="tab:green",
                   label="TPOT")
    bad = [s.result.start_s for s in samples if s.kind != "ok"]
    if bad:
        bottom.scatter(bad, [0.0] * len(bad), marker="x", color="tab:red",
                       label="rejected / error")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("request start (s)")
    bottom.legend(loc="upper left")
    load = report.get("load", {})
    fig.suptitle(f"{report.get('model_id')} - {load.get('shape')} - {load.get('workload')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(steps: Sequence[Mapping[str, Any]], knee: float | None, path: str,
               title: str = "", *, cheapest: float | None = None, currency: str = "USD") -> None:
    """Latency percentiles and goodput against offered load, the knee marked; with cost figures
    in the steps, a third panel of cost per million tokens with the cheapest load marked."""
    plt = require_matplotlib()
    loads = [float(s["offered"]) for s in steps]
    priced = any("cost" in s["report"] for s in steps)
    fig, axes = plt.subplots(3 if priced else 2, 1, figsize=(10, 11 if priced else 8),
                             sharex=True)
    lat, good = axes[0], axes[1]
    for key, label, style in (("median_ttft_ms", "TTFT P50", "-"), ("p99_ttft_ms", "TTFT P99",
                                                                    "--"),
                              ("median_tpot_ms", "TPOT P50", "-"), ("p99_tpot_ms", "TPOT P99",
                                                                    "--")):
        ys = [s["report"].get(key) for s in steps]
        lat.plot(loads, [y if y is not None else float("nan") for y in ys], style, marker="o",
                 label=label)
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.legend(loc="upper left")
    good.plot(loads, [s["report"].get("request_throughput") or 0.0 for s in steps], marker="o",
              label="throughput (req/s)")
    good.plot(loads, [s["report"].get("request_goodput") or 0.0 for s in steps], marker="o",
              label="goodput (req/s)")
    att = good.twinx()
    att.plot(loads, [s["report"].get("slo_attainment_pct") or 0.0 for s in steps], ":",
             color="gray", marker=".", label="SLO attainment %")
    att.set_ylabel("SLO attainment %")
    att.set_ylim(0, 105)
    good.set_ylabel("req/s")
    good.legend(loc="upper left")
    if priced:
        money = axes[2]
        for key, label in (("cost_per_million_tokens", "per million tokens"),
                           ("cost_per_million_goodput_tokens", "per million goodput tokens")):
            ys = [s["report"].get(key) for s in steps]
            money.plot(loads, [y if y is not None else float("nan") for y in ys], marker="o",
                       label=label)
        money.set_yscale("log")
        money.set_ylabel(currency)
        if cheapest is not None:
            at = next(s["report"].get("cost_per_million_goodput_tokens") for s in steps
                      if float(s["offered"]) == cheapest)
            money.scatter([cheapest], [at], marker="*", s=220, color="tab:green", zorder=5,
                          label=f"cheapest meeting the SLO: {cheapest:g} req/s, "
                                f"{at:,.3f} {currency}/M goodput tokens")
        money.legend(loc="upper right")
    axes[-1].set_xlabel("offered load (req/s)")
    if knee is not None:
        for ax in axes:
            ax.axvline(knee, color="tab:red", linestyle="--")
        good.annotate(f"knee {knee:g}", (knee, 0), xytext=(5, 5), textcoords="offset points",
                      color="tab:red")
    if cheapest is not None:
        for ax in axes:
            ax.axvline(cheapest, color="tab:green", linestyle=":")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
