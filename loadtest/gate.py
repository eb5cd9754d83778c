"""`loadtest gate`: the performance regression gate between two runs of the same load.

Run after every change of engine version, weights, CUDA, attention backend or quantization
(the design documents, section 8.3): the same `loadtest run` before and after, then

    loadtest gate --baseline before.json --candidate after.json

Each figure has an allowance: `p99_ttft=10%` lets P99 TTFT grow by 10%; `request_goodput=-5%`
lets goodput fall by 5%; `error_rate=0.5pp` lets the error rate grow by half a percentage point.
The sign says which way is worse and may be left out for the figures whose direction is known.
A figure beyond its allowance fails the gate (exit 1). Noise: each report carries its figures'
own standard error (`noise`, from two interleaved halves of the run); when the difference two
runs could show by chance (2 x the combined standard error) exceeds an allowance, the gate says
so, since a pass or fail of that figure is then a coin toss: run longer.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ALLOWANCES = ("median_ttft=10%,p95_ttft=10%,p99_ttft=10%,median_tpot=10%,p95_tpot=10%,"
                      "p99_tpot=10%,p99_itl=15%,p99_e2el=10%,request_throughput=-5%,"
                      "request_goodput=-5%,output_throughput=-5%,error_rate=0.5pp,"
                      "rejection_rate=1pp,slo_attainment=-1pp")
# Figures where a rise is the regression; everything else regresses by falling.
_HIGHER_IS_WORSE = re.compile(
    r"_(ttft|tpot|itl|e2el|queue)(_ms)?$|^(error|rejection)_rate|^cost_")
_LOAD_KEYS = ("rate", "concurrency", "arrival", "time_compress", "duration_s", "max_requests",
              "workload", "endpoint", "slo", "max_model_len")
_ALLOWANCE = re.compile(r"^([+-]?)(\d+(?:\.\d+)?)(%|pp)$")


class GateError(ValueError):
    """Bad input to the gate: a file, a key, an allowance; exit status 2."""


@dataclass(frozen=True, slots=True)
class Allowance:
    name: str           # as given (`p99_ttft`)
    key: str            # the report's key (`p99_ttft_ms`)
    limit: float        # magnitude: a fraction for %, points for pp
    unit: str           # "%" or "pp"
    worse_up: bool      # a rise is the regression

    def describe(self) -> str:
        sign = "+" if self.worse_up else "-"
        value = self.limit * 100 if self.unit == "%" else self.limit
        return f"{sign}{value:g}{self.unit}"


def resolve_key(name: str, report: dict[str, Any]) -> str | None:
    for key in (name, f"{name}_ms", f"{name}_pct"):
        if key in report:
            return key
    return None


def parse_allowances(text: str, report: dict[str, Any], strict: bool = True
                     ) -> list[Allowance]:
    """Allowances by report key; `strict` False skips figures the reports lack (defaults)."""
    out: list[Allowance] = []
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        m = _ALLOWANCE.match(value.strip())
        if not sep or m is None:
            raise GateError(f"--max-regress {part.strip()!r}: expected NAME=N% or NAME=Npp, "
                            "e.g. p99_ttft=10%,request_goodput=-5%,error_rate=0.5pp")
        key = resolve_key(name, report)
        if key is None and not strict:
            continue
        if key is None:
            raise GateError(f"--max-regress {name!r}: the reports have no such figure (try "
                            "p99_ttft, median_tpot, request_goodput, error_rate, ...)")
        sign, number, unit = m.group(1), float(m.group(2)), m.group(3)
        worse_up = {"+": True, "-": False}.get(sign, bool(_HIGHER_IS_WORSE.search(key)))
        if unit == "%" and key.endswith("_pct"):
            raise GateError(f"--max-regress {name}: {name} is already a percentage; give its "
                            f"allowance in points, like {name}={number:g}pp")
        out.append(Allowance(name, key, number / 100 if unit == "%" else number, unit,
                             worse_up))
    return out


def load_report(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise GateError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise GateError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise GateError(f"{path}: not a `loadtest run --out` report (no 'completed' key)")
    return data


@dataclass(frozen=True, slots=True)
class Row:
    allowance: Allowance
    base: float | None
    cand: float | None
    change: float | None      # signed: a fraction for %, points for pp
    verdict: str              # ok | REGRESSED | improved | n/a
    noisy: bool


def compare(base: dict[str, Any], cand: dict[str, Any], allowances: list[Allowance]
            ) -> list[Row]:
    rows = []
    for a in allowances:
        b, c = base.get(a.key), cand.get(a.key)
        if b is None or c is None or (isinstance(b, float) and math.isnan(b)):
            rows.append(Row(a, b, c, None, "n/a", False))
            continue
        b, c = float(b), float(c)
        if a.unit == "pp":
            change = c - b
        elif b != 0:
            change = (c - b) / abs(b)
        else:
            change = 0.0 if c == 0 else math.inf * (1 if c > 0 else -1)
        worse = change if a.worse_up else -change
        verdict = "REGRESSED" if worse > a.limit + 1e-12 else (
            "improved" if worse < -a.limit else "ok")
        nb = base.get("noise", {}).get(a.key)
        nc = cand.get("noise", {}).get(a.key)
        noisy = False
        if nb is not None and nc is not None:
            # Both are one standard error (relative for %, points for pp).
            noisy = 2 * math.sqrt(nb * nb + nc * nc) > a.limit
        rows.append(Row(a, b, c, change, verdict, noisy))
    return rows


def load_mismatch(base: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    lb, lc = base.get("load", {}), cand.get("load", {})
    return [f"{k}: {lb.get(k)!r} vs {lc.get(k)!r}" for k in _LOAD_KEYS if lb.get(k) != lc.get(k)]


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"


def render(rows: list[Row]) -> str:
    lines = [f"{'figure':<22}{'baseline':>12}{'candidate':>12}{'change':>10}{'allowed':>10}  "
             "verdict"]
    for r in rows:
        if r.change is None:
            change = "-"
        elif r.allowance.unit == "pp":
            change = f"{r.change:+.2f}pp"
        else:
            change = f"{r.change * 100:+.1f}%"
        flag = "  (noisy)" if r.noisy else ""
        lines.append(f"{r.allowance.name:<22}{_num(r.base):>12}{_num(r.cand):>12}{change:>10}"
                     f"{r.allowance.describe():>10}  {r.verdict}{flag}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", required=True, help="report of the run before the change")
    p.add_argument("--candidate", required=True, help="report of the run after the change")
    p.add_argument("--max-regress", default=None, metavar="SPEC",
                   help="allowances, e.g. p99_ttft=10%%,request_goodput=-5%%,error_rate=0.5pp "
                        "(default: a set for TTFT, TPOT, ITL, E2E, throughput, goodput, errors)")
    p.add_argument("--allow-different-load", action="store_true",
                   help="compare even when the two runs' loads differ")


def run(args: argparse.Namespace) -> int:
    try:
        base = load_report(args.baseline)
        cand = load_report(args.candidate)
        spec = args.max_regress or DEFAULT_ALLOWANCES
        allowances = parse_allowances(spec, {**base, **cand}, strict=bool(args.max_regress))
    except GateError as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    mismatch = load_mismatch(base, cand)
    if mismatch and not args.allow_different_load:
        print("loadtest: error: the two runs did not run the same load ("
              + "; ".join(mismatch) + "); a gate compares like with like "
              "(--allow-different-load to compare anyway)", file=sys.stderr)
        return 2
    rows = compare(base, cand, allowances)
    print(render(rows))
    noisy = [r.allowance.name for r in rows if r.noisy]
    if noisy:
        print(f"warning: the runs' own spread is wider than the allowance for "
              f"{', '.join(noisy)}: their verdicts may be chance; run longer or repeat",
              file=sys.stderr)
    for w in (base.get("generator", {}), cand.get("generator", {})):
        if w.get("saturated"):
            print("warning: a run's load generator neared a full core; its latencies may be "
                  "the generator's own", file=sys.stderr)
    failed = [r for r in rows if r.verdict == "REGRESSED"]
    if failed:
        print(f"gate: FAIL: {len(failed)} figure(s) regressed beyond their allowance: "
              + ", ".join(r.allowance.name for r in failed))
        return 1
    print("gate: PASS")
    return 0
