"""The soak and chaos benchmark's short variant (issue 16): every fault once, under load.

`benchmarks/soak.py` runs two replicas sharing a Redis in front of two simulated engines and,
window by window, stops Redis for 20 s, restarts it, kills and restarts an engine, stalls an
engine's streams, sends slow readers and slow request heads, reloads the policy on one
replica then the other, and has an engine split its SSE frames and space its JSON while a
flood of requests whose bodies never finish is held open on one replica. Here it runs its
~2-minute schedule at a light load with short outputs, and the test holds it to the goals: no
5xx failure from the gateway, nothing reserved in Redis or on the replicas after any window, no
quota tokens held back, memory back near its start, every stream valid while the engine splits
its frames, and none of the flood's connections left on the replica after it. The figures of
the long runs are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.servers import ROOT

FAULTS = ["redis-stop", "redis-restart", "engine-kill", "engine-stall", "slow-clients",
          "reload", "split-flood"]


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("soak")
    out = tmp / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "2",
           "--rate", "1", "--synthetic", "in=lognormal:600:2500,out=uniform:16:96",
           "--drain", "30", "--workdir", str(tmp / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-6000:])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.timeout(400)
def test_every_fault_happened(soak: dict[str, Any]) -> None:
    assert [w["name"] for w in soak["windows"] if w["kind"] == "fault"] == FAULTS
    events = [e["event"] for e in soak["events"]]
    for what in ("redis SIGSTOP", "redis SIGCONT", "redis SIGKILL", "redis started again",
                 "engine e0 SIGKILL", "engine e0 started again", "engine e1 stalls every stream",
                 "engine e1 stall fault cleared", "slow clients done",
                 "engine e0 splits its frames", "flood done", "engine e0 split fault cleared"):
        assert what in events, events
    reload = next(w for w in soak["windows"] if w["name"] == "reload")["observed"]
    assert reload["sighup_A"]["ok"] and reload["sighup_B"]["ok"], reload
    # The tenant the edit adds: known to A after its SIGHUP, to both after B's.
    assert reload["new_key_after_A"] == [200, 401], reload
    assert reload["new_key_after_B"] == [200, 200], reload
    slow = next(w for w in soak["windows"] if w["name"] == "slow-clients")["observed"]
    heads = [c for c in slow["slow_clients"] if c["kind"] == "header"]
    assert heads and all(c["ended"].startswith("closed by server") for c in heads), heads
    readers = [c for c in slow["slow_clients"] if c["kind"] == "reader" and not c["leave"]]
    assert readers and all(c["done"] for c in readers), readers


@pytest.mark.timeout(400)
def test_no_5xx_from_the_gateway(soak: dict[str, Any]) -> None:
    failures = [f for w in soak["windows"] for f in w["failures"]]
    assert sum(w["failure_count"] for w in soak["windows"]) == 0, failures
    assert soak["outcomes"].get("200", 0) > 0, soak["outcomes"]


@pytest.mark.timeout(400)
def test_nothing_reserved_after(soak: dict[str, Any]) -> None:
    for w in soak["windows"]:
        assert w["quiet"], (w["name"], w["busy_after"])
        assert w["redis_held_after"] == 0, (w["name"], w["redis_after"])
    after = soak["redis_after"]
    assert after["leases"] == after["expiry"] == after["tokens"] == 0, after
    assert not any(after["blocks"].values()) and not any(after["tenants"].values()), after
    for g in soak["replicas"]:
        assert g["kv_blocks_reserved_after"] == 0 and g["inflight_after"] == 0, g


@pytest.mark.timeout(400)
def test_no_quota_held_back(soak: dict[str, Any]) -> None:
    """Outside the Redis faults (where quotas are not charged by design), each day bucket's
    level moved by exactly its refill less what the replicas charged."""
    judged = [(w["name"], t, v["drift"]) for w in soak["windows"]
              if w["name"] not in ("redis-stop", "redis-restart")
              for t, v in w["ledger"].items() if v.get("exact")]
    assert len(judged) >= 8, soak["windows"]
    assert all(abs(d) < 1.0 for _, _, d in judged), judged


@pytest.mark.timeout(400)
def test_memory_back_near_its_start(soak: dict[str, Any]) -> None:
    for g in soak["replicas"]:
        # Generous: two minutes are too short for the 10% goal to mean much either way.
        assert g["rss_end_vs_start_pct"] is not None and g["rss_end_vs_start_pct"] < 50, g


@pytest.mark.timeout(400)
def test_split_frames_and_the_flood(soak: dict[str, Any]) -> None:
    """While engine e0 splits its SSE frames at random bytes and spaces half its streams'
    JSON: every checked stream is valid and the usage its callers saw is what was charged.
    A flood of requests whose bodies never finish, held open on replica A, then closed: the
    replica closes them itself and none of them is left open on it after."""
    window = next(w for w in soak["windows"] if w["name"] == "split-flood")
    checked, flood = window["observed"]["checked"], window["observed"]["flood"]
    assert checked["streams"] >= 4 and checked["by_backend"].get("e0", 0) > 0, checked
    assert checked["bad"] == 0, checked
    for tenant, v in window["usage_vs_charged"].items():
        assert not v["complete"] or v["seen"] == v["charged"], (tenant, v)
    # The bad key is refused before the body is read.
    assert flood["by_kind"]["bad-key"]["statuses"] == {"401": flood["by_kind"]["bad-key"]["sent"]}
    assert flood["open_peak"] > flood["open_before"], flood  # the flood reached the replica
    # The replica closed each one itself past its body timeout, and none is left after.
    assert flood["flood_held_at_hold_end"] == 0 and flood["flood_left"] == 0, flood
