"""One self-contained HTML file of a run, a sweep or a calibration (`--report FILE.html`).

Everything is inside the file: the plots are PNGs drawn with matplotlib and inlined as base64
`data:` URLs, the style is one `<style>` block, and there is no script, font or link to fetch,
so it opens the same on a laptop on a plane as on the machine that ran the load.

What it shows:
- a run: TTFT and TPOT of every request over the run, against the SLO lines, with rejections
  and errors marked; the CDFs of TTFT and TPOT with the SLO lines and the share within each;
  when the target is a gateway, its admission decisions by reason, per second, read from its
  `/metrics` during the run (loadtest/gateway_metrics.py);
- a sweep: goodput, throughput and SLO attainment against the offered load, with the knee and
  the saturation rate marked, and TTFT/TPOT percentiles against load with the SLO lines;
- a calibration: the sweep, and the engine state at each step (in-flight tokens, prefill
  backlog, KV usage, waiting) with the thresholds it learned drawn where they sit;
- `loadtest overload`: the direct run and the gateway's side by side.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.plot import require_matplotlib
from loadtest.report import Sample, SloError, parse_slo

STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1180px; color: #222; background: #fff; line-height: 1.4; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.meta { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f4f4; }
img { max-width: 100%; height: auto; display: block; margin: 0.4em 0; }
.verdict { font-weight: bold; padding: 0.6em; background: #eef6ee; border-left: 4px solid #393; }
.verdict.bad { background: #f8eeee; border-left-color: #c33; }
.cols { display: flex; gap: 1em; } .cols > div { flex: 1; min-width: 0; }
"""


def require_pyplot() -> Any:
    return require_matplotlib("--report needs matplotlib")


# --- the page -----------------------------------------------------------------------------------


class Page:
    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []

    def h2(self, text: str) -> None:
        self.parts.append(f"<h2>{html.escape(text)}</h2>")

    def p(self, text: str, cls: str = "") -> None:
        attr = f' class="{cls}"' if cls else ""
        self.parts.append(f"<p{attr}>{html.escape(text)}</p>")

    def table(self, rows: Sequence[Sequence[Any]], header: bool = True) -> None:
        out = ["<table>"]
        for i, row in enumerate(rows):
            tag = "th" if header and i == 0 else "td"
            out.append("<tr>" + "".join(f"<{tag}>{html.escape(_cell(c))}</{tag}>" for c in row)
                       + "</tr>")
        out.append("</table>")
        self.parts.append("".join(out))

    def figure(self, fig: Any, alt: str) -> None:
        plt = require_pyplot()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=96)
        plt.close(fig)
        data = base64.b64encode(buf.getvalue()).decode()
        self.parts.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')

    def raw(self, text: str) -> None:
        self.parts.append(text)

    def render(self) -> str:
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
                '<link rel="icon" href="data:,">'  # no favicon to fetch
                f"<title>{html.escape(self.title)}</title><style>{STYLE}</style></head><body>"
                f"<h1>{html.escape(self.title)}</h1>"
                f"<p class=\"meta\">written by loadtest on {time.strftime('%Y-%m-%d %H:%M:%S %z')}"
                "; self-contained: no network needed</p>"
                + "\n".join(self.parts) + "</body></html>\n")

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.render())


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _slo(report: Mapping[str, Any]) -> dict[str, float]:
    """The run's SLO in seconds, read back from the report's `load.slo` (`ttft=2000ms,...`)."""
    text = (report.get("load") or {}).get("slo") or ""
    try:
        return parse_slo(text) if text else {}
    except SloError:
        return {}


# --- runs ---------------------------------------------------------------------------------------


SUMMARY_KEYS = (
    ("sent", "sent"), ("completed", "completed"), ("rejected (429/503)", "rejected"),
    ("errors", "errors"), ("Retry-After, median (s)", "retry_after_median_s"),
    ("request throughput (req/s)", "request_throughput"),
    ("goodput (req/s within the SLO)", "request_goodput"),
    ("SLO attainment (% of sent)", "slo_attainment_pct"),
    ("TTFT P50 (ms)", "median_ttft_ms"), ("TTFT P99 (ms)", "p99_ttft_ms"),
    ("TPOT P50 (ms)", "median_tpot_ms"), ("TPOT P99 (ms)", "p99_tpot_ms"),
    ("E2E P99 (ms)", "p99_e2el_ms"), ("output tokens/s", "output_throughput"),
    ("duration (s)", "duration"),
)


def summary_rows(reports: Mapping[str, Mapping[str, Any]]) -> list[list[Any]]:
    rows: list[list[Any]] = [["", *reports]]
    for label, key in SUMMARY_KEYS:
        rows.append([label, *(r.get(key) for r in reports.values())])
    return rows


def latency_figure(samples: Sequence[Sample], slo: Mapping[str, float], title: str,
                   cut: Sequence[tuple[float, float | None]] = (), end_s: float = 0.0) -> Any:
    """TTFT and TPOT of every request against its start time, SLO lines dashed; `cut`: the
    (start, TTFT or None) of requests cancelled at the run's end (`end_s`), drawn too."""
    plt = require_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.2), sharex=True)
    ok = [s for s in samples if s.kind == "ok" and s.result.ttft_s is not None]
    top.scatter([s.result.start_s for s in ok], [s.result.ttft_s for s in ok], s=7,
                color="tab:blue", label="TTFT (completed)")
    partial = [(s.result.start_s, s.result.ttft_s) for s in samples
               if s.kind != "ok" and s.result.ttft_s is not None]
    partial += [(start, t) for start, t in cut if t is not None]
    if partial:
        top.scatter([a for a, _ in partial], [b for _, b in partial], s=7, color="tab:purple",
                    alpha=0.6, label=f"TTFT, did not complete ({len(partial)})")
    waiting = [(start, end_s - start) for start, t in cut if t is None]
    if waiting:
        top.scatter([a for a, _ in waiting], [b for _, b in waiting], s=9, marker="^",
                    color="tab:gray", label=f"no first token when the run ended ({len(waiting)})")
    tpots = [(s.result.start_s, t) for s in ok if (t := s.tpot_s) is not None]
    bottom.scatter([a for a, _ in tpots], [b * 1000 for _, b in tpots], s=7, color="tab:green",
                   label="TPOT")
    refused = [s.result.start_s for s in samples if s.kind == "rejected"]
    failed = [s.result.start_s for s in samples if s.kind not in ("ok", "rejected")]
    for ax in (top, bottom):  # refusals and failures along the bottom, when they were sent
        if refused:
            ax.scatter(refused, [0.0] * len(refused), marker="|", color="tab:red", s=40,
                       label=f"rejected ({len(refused)})")
        if failed:
            ax.scatter(failed, [0.0] * len(failed), marker="x", color="black", s=20,
                       label=f"error ({len(failed)})")
    if "ttft" in slo:
        top.axhline(slo["ttft"], color="tab:red", linestyle="--", label=f"SLO {slo['ttft']:g} s")
    if "tpot" in slo:
        bottom.axhline(slo["tpot"] * 1000, color="tab:red", linestyle="--",
                       label=f"SLO {slo['tpot'] * 1000:g} ms")
    top.set_ylabel("TTFT (s)")
    bottom.set_ylabel("TPOT (ms)")
    bottom.set_xlabel("request sent at (s since the run began)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def cdf_figure(runs: Mapping[str, Sequence[Sample]], slo: Mapping[str, float]) -> Any:
    """CDFs of TTFT and TPOT (completed requests) per run, the SLO lines and the share within."""
    plt = require_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, unit, label in ((axes[0], "ttft", 1.0, "TTFT (s)"),
                                 (axes[1], "tpot", 1000.0, "TPOT (ms)")):
        for name, samples in runs.items():
            values = sorted(v for s in samples if s.kind == "ok"
                            and (v := s.result.ttft_s if key == "ttft" else s.tpot_s)
                            is not None)
            if not values:
                continue
            xs = [v * unit for v in values]
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            share = ""
            if key in slo:
                within = sum(1 for v in values if v <= slo[key])
                share = f", {100 * within / len(values):.0f}% within the SLO"
            ax.step(xs, ys, where="post", label=f"{name}{share}")
        if key in slo:
            ax.axvline(slo[key] * unit, color="tab:red", linestyle="--",
                       label=f"SLO {slo[key] * unit:g} {'s' if key == 'ttft' else 'ms'}")
        ax.set_xlabel(label + " of completed requests")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def decisions_figure(rows: Sequence[Mapping[str, Any]], title: str = "") -> Any | None:
    """The gateway's admission decisions by `decision/reason`, per second, over the run."""
    if len(rows) < 2:
        return None
    plt = require_pyplot()
    keys = sorted({k for r in rows for k, v in r["decisions"].items() if v})
    if not keys:
        return None
    fig, (ax, gauges) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    ts = [float(r["t"]) for r in rows]
    for key in keys:
        per_s = [0.0]
        for a, b in itertools.pairwise(rows):
            dt = max(1e-6, float(b["t"]) - float(a["t"]))
            per_s.append((b["decisions"].get(key, 0.0) - a["decisions"].get(key, 0.0)) / dt)
        style = "-" if key.startswith(("admitted", "queued")) else "--"
        ax.plot(ts, per_s, style, label=key)
    ax.set_ylabel("decisions per second")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    ax.set_title(title or "the gateway's admission decisions, by reason (from its /metrics)")
    for key, label in (("inflight_requests", "requests in flight"), ("queued", "queued")):
        if any(key in r for r in rows):
            gauges.plot(ts, [float(r.get(key) or 0) for r in rows], label=label)
    right = gauges.twinx()
    if any("prefill_pending_tokens" in r for r in rows):
        right.plot(ts, [float(r.get("prefill_pending_tokens") or 0) for r in rows], ":",
                   color="tab:gray", label="prompt tokens awaiting a first token (right)")
    right.set_ylabel("tokens")
    right.legend(loc="upper right", fontsize=8)
    gauges.set_ylabel("requests")
    gauges.set_xlabel("s since the run began")
    gauges.legend(loc="upper left", fontsize=8)
    gauges.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def add_decisions(page: Page, rows: Sequence[Mapping[str, Any]] | None, title: str = "") -> None:
    if not rows:
        return
    fig = decisions_figure(rows, title)
    if fig is None:
        return
    page.h2("Gateway decisions over time")
    page.figure(fig, "admission decisions by reason per second")
    last = rows[-1]["decisions"]
    page.table([["decision/reason", "count"],
                *[[k, int(v)] for k, v in sorted(last.items(), key=lambda kv: -kv[1]) if v]])


def write_run(path: str, report: Mapping[str, Any], samples: Sequence[Sample],
              timeline: Sequence[Mapping[str, Any]] | None = None) -> None:
    """`loadtest run --report`: one run."""
    load = report.get("load", {})
    page = Page(f"loadtest run: {report.get('model_id')}, {load.get('shape')}")
    page.p(f"target {report.get('base_url')}; workload {load.get('workload')}; SLO "
           f"{_slo_text(report)}", "meta")
    page.h2("Summary")
    page.table(summary_rows({"this run": report}))
    slo = _slo(report)
    page.h2("Latency over the run")
    page.figure(latency_figure(samples, slo, ""), "TTFT and TPOT over the run")
    page.h2("TTFT and TPOT against the SLO")
    page.figure(cdf_figure({"this run": samples}, slo), "CDFs of TTFT and TPOT")
    add_decisions(page, timeline)
    page.write(path)


def _slo_text(report: Mapping[str, Any]) -> str:
    slo = _slo(report)
    if not slo:
        return "none"
    return ", ".join(f"{k} {v * 1000:g} ms" if v < 1 else f"{k} {v:g} s" for k, v in slo.items())


# --- sweeps and calibration ---------------------------------------------------------------------


def sweep_figure(steps: Sequence[Mapping[str, Any]], head: Mapping[str, Any]) -> Any:
    """Goodput, throughput and attainment against load; the knee and the saturation rate."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.6))
    loads = [float(s["offered"]) for s in steps]
    ax.plot(loads, loads, ":", color="lightgray", label="offered")
    ax.plot(loads, [s["report"].get("request_throughput") or 0.0 for s in steps], marker="o",
            label="throughput (req/s)")
    ax.plot(loads, [s["report"].get("request_goodput") or 0.0 for s in steps], marker="o",
            label="goodput (req/s within the SLO)")
    att = ax.twinx()
    att.plot(loads, [s["report"].get("slo_attainment_pct") or 0.0 for s in steps], "--",
             color="tab:gray", marker=".", label="SLO attainment (%)")
    target = head.get("target_attainment_pct")
    if target is not None:
        att.axhline(float(target), color="tab:gray", linewidth=0.8, linestyle=":")
    att.set_ylim(0, 105)
    att.set_ylabel("SLO attainment (%)")
    knee, sat = head.get("knee_rate"), head.get("saturation_rate")
    if knee is not None:
        ax.axvline(float(knee), color="tab:red", linestyle="--")
        ax.annotate(f"knee {float(knee):g} req/s", (float(knee), 0.0),
                    xycoords=("data", "axes fraction"), xytext=(-4, 18),
                    textcoords="offset points", color="tab:red", ha="right")
    if sat is not None:
        ax.axvline(float(sat), color="tab:orange", linestyle="-.")
        ax.annotate(f"saturation {float(sat):.2f} req/s"
                    + ("" if head.get("saturated") else " (at least)"), (float(sat), 0.0),
                    xycoords=("data", "axes fraction"), xytext=(-4, 4),
                    textcoords="offset points", color="tab:orange", ha="right")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("req/s")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    more = att.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def percentile_figure(steps: Sequence[Mapping[str, Any]], slo: Mapping[str, float]) -> Any:
    plt = require_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    loads = [float(s["offered"]) for s in steps]
    for ax, name, unit, key in ((axes[0], "TTFT", "s", "ttft"), (axes[1], "TPOT", "ms", "tpot")):
        scale = 1000.0 if unit == "s" else 1.0
        for stat, style in (("median", "-"), ("p99", "--")):
            ys = [s["report"].get(f"{stat}_{key}_ms") for s in steps]
            ax.plot(loads, [y / scale if y is not None else float("nan") for y in ys], style,
                    marker="o", label=f"{name} {'P50' if stat == 'median' else 'P99'}")
        if key in slo:
            line = slo[key] if unit == "s" else slo[key] * 1000
            ax.axhline(line, color="tab:red", linestyle="--", label=f"SLO {line:g} {unit}")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(f"{name} ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


STATE = (("in_flight_tokens", "in-flight tokens", "inflight_tokens_max"),
         ("prefill_tokens", "prefill backlog (tokens, one engine)", "prefill_tokens_max"),
         ("kv_usage", "KV usage (0-1)", "kv_usage_max"),
         ("waiting", "waiting requests (one engine)", "waiting_max"))


def state_figure(steps: Sequence[Mapping[str, Any]], learned: Mapping[str, Any],
                 statistic: str, knee: float | None) -> Any | None:
    """The engine state calibrate scraped at each step, the learned thresholds as lines."""
    if not any("engine_state" in s for s in steps):
        return None
    plt = require_pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True)
    loads = [float(s["offered"]) for s in steps]
    for ax, (key, label, threshold) in zip(axes.flat, STATE, strict=True):
        ys = [(s.get("engine_state") or {}).get(f"{key}_{statistic}") for s in steps]
        ax.plot(loads, [y if y is not None else float("nan") for y in ys], marker="o",
                label=f"{statistic} at each step")
        if learned.get(threshold) is not None:
            ax.axhline(float(learned[threshold]), color="tab:green", linestyle="--",
                       label=f"learned {threshold} = {learned[threshold]:g}")
        if knee is not None:
            ax.axvline(knee, color="tab:red", linestyle=":", label="knee")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("offered load (req/s)")
    fig.tight_layout()
    return fig


def step_rows(steps: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    rows: list[list[Any]] = [["rate", "sent", "served", "goodput", "SLO %", "TTFT P50 ms",
                              "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms", "rejected %",
                              "errors %"]]
    for s in steps:
        r = s["report"]
        rows.append([f"{float(s['offered']):g}", r.get("sent"), r.get("served_rate"),
                     r.get("request_goodput"), r.get("slo_attainment_pct"),
                     r.get("median_ttft_ms"), r.get("p99_ttft_ms"), r.get("median_tpot_ms"),
                     r.get("p99_tpot_ms"), r.get("rejection_rate_pct"), r.get("error_rate_pct")])
    return rows


def write_sweep(path: str, result: Mapping[str, Any], *, title: str,
                learned: Mapping[str, Any] | None = None, statistic: str = "p90",
                timeline: Sequence[Mapping[str, Any]] | None = None) -> None:
    """`loadtest sweep --report` (and calibrate's, with what it learned)."""
    head, steps = result["sweep"], result["steps"]
    page = Page(title)
    page.p(f"workload {head.get('workload')}; arrivals {head.get('arrival')}; "
           f"{head.get('duration_s')} s a step; SLO {head.get('slo')}; knee: the highest rate "
           f"keeping SLO attainment >= {head.get('target_attainment_pct')}%", "meta")
    knee, sat = head.get("knee_rate"), head.get("saturation_rate")
    page.table([["knee (req/s)", "saturation (req/s)", "saturation reached"],
                ["none" if knee is None else f"{float(knee):g}",
                 "-" if sat is None else f"{float(sat):.2f}",
                 "yes" if head.get("saturated") else "no (a lower bound)"]])
    page.h2("Goodput and SLO attainment against load")
    page.figure(sweep_figure(steps, head), "goodput and attainment against offered load")
    slo = _slo(steps[0]["report"]) if steps else {}
    page.h2("TTFT and TPOT against load, and the SLO")
    page.figure(percentile_figure(steps, slo), "latency percentiles against load")
    page.h2("Steps")
    page.table(step_rows(steps))
    if learned is not None:
        page.h2("What calibrate learned")
        fig = state_figure(steps, learned, statistic, float(knee) if knee is not None else None)
        if fig is not None:
            page.figure(fig, "engine state at each step with the learned thresholds")
        page.table([["threshold", "learned"],
                    *[[k, v] for k, v in learned.items() if k != "provenance"]])
        prov = learned.get("provenance") or {}
        if prov:
            page.table([["provenance", ""], *[[k, v] for k, v in prov.items()]])
    add_decisions(page, timeline)
    page.write(path)


# --- overload -----------------------------------------------------------------------------------


def write_overload(path: str, runs: Mapping[str, Mapping[str, Any]],
                   outcomes: Mapping[str, Any], timelines: Mapping[str, Sequence[Any]],
                   cut: Mapping[str, Sequence[tuple[float, float | None]]], *, title: str,
                   verdict: str = "", good: bool = True) -> None:
    """`loadtest overload --report`: direct and through the gateway, side by side."""
    page = Page(title)
    if verdict:
        page.p(verdict, "verdict" if good else "verdict bad")
    page.h2("Side by side")
    rows = summary_rows({"direct": runs["direct"], "through the gateway": runs["gateway"]})
    rows.insert(11, ["TTFT P99, every request let in, finished or not (ms)", *(
        ("at least " if r.get("p99_ttft_first_token_at_least") else "")
        + _cell(r.get("p99_ttft_first_token_ms")) for r in (runs["direct"], runs["gateway"]))])
    page.table(rows)
    slo = _slo(runs["gateway"])
    page.h2("Latency over the run")
    page.raw('<div class="cols">')
    for side, label in (("direct", "direct to the engines"), ("gateway", "through the gateway")):
        page.raw("<div>")
        page.figure(latency_figure(outcomes[side].samples, slo, label, cut.get(side, ()),
                                   outcomes[side].wall_s), f"latency, {label}")
        page.raw("</div>")
    page.raw("</div>")
    page.h2("TTFT and TPOT against the SLO")
    page.figure(cdf_figure({"direct": outcomes["direct"].samples,
                            "through the gateway": outcomes["gateway"].samples}, slo),
                "CDFs of TTFT and TPOT, direct and through the gateway")
    add_decisions(page, timelines.get("gateway"))
    page.write(path)
