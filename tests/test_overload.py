"""`loadtest overload` (`make overload`, issue 20): the demo's engines past saturation, direct
and through the gateway, side by side, in one command.

Shortened here (10 s of arrivals instead of 25; 256-token answers at ~50 ms a token take most
of the 12 s drain): the demo's two simulated Qwen2.5-72B replicas at twice their roofline's
saturation rate collapse when driven directly (every request gets into the batch, none
finishes in time), while the gateway serves a steady share within the SLO and refuses the
rest at once with Retry-After.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.servers import ROOT, loadtest_cmd


def test_overload_shows_the_gateway_protecting_the_demos_engines(tmp_path: Path) -> None:
    report = tmp_path / "overload.html"
    done = subprocess.run(loadtest_cmd("overload", "--duration", "10", "--drain", "12",
                                       "--report", str(report)),
                          capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "2 x the roofline's saturation rate" in out
    for label in ("goodput (req/s within the SLO)", "P99 TTFT, completed requests (s)",
                  "rejected (429/503, with Retry-After)", "  Retry-After, median"):
        assert label in out, label
    good = re.search(r"goodput \(req/s within the SLO\)\s+([\d.]+)\s+([\d.]+)", out)
    assert good is not None, out
    direct, gateway = float(good.group(1)), float(good.group(2))
    assert gateway >= 1.3 * direct and gateway > 0, out
    verdict = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert len(verdict) == 1 and verdict[0].startswith("verdict: PROTECTED"), out
    assert "refused" in verdict[0] and "retry after" in verdict[0]
    assert f"report written to {report}" in done.stderr
    text = report.read_text()
    assert "Side by side" in text and "Gateway decisions over time" in text
