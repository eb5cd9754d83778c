"""The proxy benchmark's stall tracer (benchmarks/stall_site/stall_tracer.py): each process's
GC pauses and loop lateness, laid beside the streams' stalls on the one clock they share. Kept
running here so part C's explanations do not rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.stall_site import stall_tracer

ROOT = Path(__file__).resolve().parent.parent


def test_a_burst_of_stalls_is_laid_beside_what_overlapped_it(tmp_path: Path) -> None:
    (tmp_path / "gateway-1.txt").write_text("late 100.020000 11.70\ngc 300.0 5.0 0\n")
    (tmp_path / "stub_engine-2.txt").write_text("gc 100.030000 2.00 1\nlate 50.0 4.0\n")
    (tmp_path / "client-3.txt").write_text("")
    # 106 streams whose longest gap began within a few ms of each other, past 20 ms by 12.
    stalls = [(100.0 + i * 1e-5, 0.012) for i in range(106)] + [(200.0, 0.001)]
    lines = stall_tracer.explain(str(tmp_path), stalls)
    assert len(lines) == 1  # one burst; the 1 ms stall is under the 5 ms worth explaining
    assert lines[0].startswith("106 streams stalled up to 12.0 ms from 100.000: ")
    assert "gateway late 11.7 ms at +20 ms" in lines[0]
    assert "engine gc gen1 2.0 ms at +30 ms" in lines[0]
    assert "50.0" not in lines[0] and "300" not in lines[0]  # not overlapping: left out


def test_the_site_traces_a_process_started_with_it(tmp_path: Path) -> None:
    # What the benchmark does for the gateway and the engine: PYTHONPATH and the folder.
    env = {**os.environ, stall_tracer.ENV: str(tmp_path),
           "PYTHONPATH": str(ROOT / "benchmarks" / "stall_site")}
    code = ("import asyncio, time, uvloop\n"
            "async def main():\n"
            "    time.sleep(0.02)  # the loop held: its heartbeat runs late\n"
            "    await asyncio.sleep(0.01)\n"
            "uvloop.run(main())\n")
    traces = tmp_path / "traces"
    traces.mkdir()
    env[stall_tracer.ENV] = str(traces)
    script = tmp_path / "held.py"
    script.write_text(code)
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    events = stall_tracer.read(str(traces))
    assert any(role == "held" and kind == "late" and ms > 10 for _, role, kind, ms, _ in events)
