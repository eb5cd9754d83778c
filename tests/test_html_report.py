"""`--report FILE.html` (issue 20): one self-contained file, opened in a real headless browser.

`loadtest run` through a gateway (its decisions over time read from /metrics), `loadtest
sweep` and `loadtest calibrate` write their reports against real servers on loopback; each is
opened in Chromium (Debian's package, installed here when missing and we are root), which must
load it with no console error, no exception and no request for anything outside the file, with
every plot decoded; its `--screenshot` must show the plots, not a blank page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import loadtest_cmd

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage")
SLO = "ttft=500ms,tpot=50ms"
LOAD = ("--synthetic", "in=512,out=64", "--no-progress")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium; installed with apt when missing (as root), else a failure."""
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            subprocess.run(install, env=env, capture_output=True, timeout=900, check=True)
        found = shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is not installed (Debian: apt-get install chromium; the suite "
                    "installs it when run as root)")
    return found


@contextmanager
def _profile() -> Iterator[str]:
    """A profile directory for one Chromium, removed once every process of it is gone.

    Chromium runs as a process group (browser, renderers, GPU and crashpad helpers); killing
    only the browser left a helper writing into the profile while it was being removed
    ("Directory not empty: 'Default'", seen in a clean-clone run). So each Chromium is
    started in a session of its own and the whole group is killed before the removal.
    """
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        yield profile
    finally:
        for attempt in range(20):  # a helper killed a moment ago may still hold a file open
            try:
                shutil.rmtree(profile)
                break
            except OSError:
                if attempt == 19:
                    raise
                time.sleep(0.1)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@contextmanager
def browser(binary: str) -> Iterator[str]:
    """A headless Chromium with a DevTools port; yields the port's base URL."""
    with _profile() as profile:
        proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}",
                                 "--remote-debugging-port=0", "about:blank"],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            assert proc.stderr is not None
            for raw in proc.stderr:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/..."
                m = re.search(rb"DevTools listening on ws://([\d.]+:\d+)/", raw)
                if m:
                    break
            else:
                raise AssertionError("chromium exited before opening its DevTools port")
            yield f"http://{m.group(1).decode()}"
        finally:
            _kill_group(proc)


async def open_page(devtools: str, url: str) -> dict[str, Any]:
    """Load `url` in a page; what the console said, what was requested, the images' state."""
    async with aiohttp.ClientSession() as session:
        async with session.get(devtools + "/json/list") as resp:
            page = next(t for t in await resp.json() if t["type"] == "page")
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 10_000))
            errors: list[str] = []
            requests: list[str] = []

            async def call(method: str, **params: Any) -> dict[str, Any]:
                mine = next(ids)
                await ws.send_json({"id": mine, "method": method, "params": params})
                while True:
                    msg = json.loads((await ws.receive()).data)
                    if msg.get("id") == mine:
                        result: dict[str, Any] = msg.get("result", {})
                        return result
                    watch(msg)

            loaded = asyncio.Event()

            def watch(msg: dict[str, Any]) -> None:
                method, params = msg.get("method"), msg.get("params", {})
                if method == "Runtime.exceptionThrown":
                    errors.append(str(params["exceptionDetails"]))
                elif method == "Runtime.consoleAPICalled" and params["type"] in ("error",
                                                                                   "assert"):
                    errors.append(str(params["args"]))
                elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                    errors.append(params["entry"]["text"])
                elif method == "Network.requestWillBeSent":
                    requests.append(params["request"]["url"])
                elif method == "Page.loadEventFired":
                    loaded.set()

            for domain in ("Runtime", "Log", "Page", "Network"):
                await call(f"{domain}.enable")
            await call("Page.navigate", url=url)
            async with asyncio.timeout(30):
                while not loaded.is_set():
                    watch(json.loads((await ws.receive()).data))
            await asyncio.sleep(0.3)  # late console messages
            while True:
                try:
                    async with asyncio.timeout(0.2):
                        watch(json.loads((await ws.receive()).data))
                except TimeoutError:
                    break
            images = (await call("Runtime.evaluate", returnByValue=True, expression=(
                "Array.from(document.images).map(i => [i.complete, i.naturalWidth, "
                "i.naturalHeight])")))["result"]["value"]
            title = (await call("Runtime.evaluate", returnByValue=True,
                                expression="document.title"))["result"]["value"]
    return {"errors": errors, "requests": requests, "images": images, "title": title}


def screenshot(binary: str, url: str, out: Path) -> None:
    with _profile() as profile:
        proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}",
                                 "--window-size=1280,2400", f"--screenshot={out}", url],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=60)
        finally:
            _kill_group(proc)  # the helpers it leaves behind, too
    assert proc.returncode == 0 and out.exists(), stderr[-2000:]


def not_blank(png: Path) -> tuple[float, int]:
    """(share of pixels that are not white, distinct colours): a blank page is (0, 1)."""
    from matplotlib import image

    pixels = image.imread(str(png))[..., :3]
    inked = float((pixels.min(axis=2) < 0.9).mean())
    colours = len({tuple(p) for p in (pixels[::7, ::7] * 255).astype(int).reshape(-1, 3)})
    return inked, colours


def check_in_browser(binary: str, report: Path, plots: int, tmp_path: Path) -> None:
    text = report.read_text()
    assert "<script" not in text and "http://" not in text.split("<body>", 1)[1].replace(
        "http://127.0.0.1", "")  # nothing to fetch, nothing to run
    url = report.resolve().as_uri()
    with browser(binary) as devtools:
        page = asyncio.run(open_page(devtools, url))
    assert page["errors"] == [], page["errors"]
    assert page["title"].startswith("loadtest ")
    assert [r for r in page["requests"] if not r.startswith(("file:", "data:"))] == []
    assert len(page["images"]) >= plots, page["images"]
    assert all(ok and w > 300 and h > 200 for ok, w, h in page["images"]), page["images"]
    shot = tmp_path / f"{report.stem}.png"
    screenshot(binary, url, shot)
    inked, colours = not_blank(shot)
    assert inked > 0.01 and colours > 50, (inked, colours)  # a blank page: 0 and 1


def loadtest(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(loadtest_cmd(*args), capture_output=True, text=True, timeout=timeout)


def test_run_report_through_a_gateway_opens_in_a_browser_with_its_decisions(
        chromium: str, start_sim: StartSim, start_gateway: StartGateway,
        tmp_path: Path) -> None:
    report = tmp_path / "run.html"
    with start_sim("--num-gpu-blocks", "80") as sim, \
            start_gateway(policy_yaml([sim.url], pool_extra=(
                "    admission: {queue_size: 4, queue_wait_max_s: 0.5}\n"))) as gw:
        done = loadtest("run", "--url", gw.url, *LOAD, "--rate", "12", "--duration", "3",
                        "--slo", SLO, "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert f"report written to {report}" in done.stderr
    text = report.read_text()
    for section in ("Latency over the run", "TTFT and TPOT against the SLO",
                    "Gateway decisions over time", "admitted/fits"):
        assert section in text, section
    assert "rejected/" in text  # 12 req/s of 576 tokens on 1,280 KV tokens: some are refused
    check_in_browser(chromium, report, 3, tmp_path)


def test_sweep_and_calibrate_reports_open_in_a_browser(chromium: str, start_sim: StartSim,
                                                       tmp_path: Path) -> None:
    sweep, calibrated = tmp_path / "sweep.html", tmp_path / "calibrate.html"
    policy = tmp_path / "policy.yaml"
    with start_sim("--num-gpu-blocks", "180") as sim:
        done = loadtest("sweep", "--url", sim.url, *LOAD, "--arrival", "constant", "--rates",
                        "2,8", "--duration", "1.5", "--pause", "0.2", "--slo", SLO,
                        "--target-attainment", "90", "--report", str(sweep))
        assert done.returncode == 0, done.stderr
        policy.write_text(policy_yaml([sim.url]))
        done = loadtest("calibrate", "--policy", str(policy), "--pool", "default", *LOAD,
                        "--arrival", "constant", "--rates", "2.5,5,10", "--duration", "1.5",
                        "--pause", "0.2", "--slo", SLO, "--target-attainment", "90",
                        "--report", str(calibrated))
        assert done.returncode == 0, done.stderr
    text = sweep.read_text()
    assert "Goodput and SLO attainment against load" in text and "knee" in text
    check_in_browser(chromium, sweep, 2, tmp_path)
    text = calibrated.read_text()
    assert "What calibrate learned" in text and "inflight_tokens_max" in text
    assert "knee_rate_rps" in text  # the provenance
    check_in_browser(chromium, calibrated, 3, tmp_path)


def test_the_browser_check_sees_a_console_error_and_a_blank_page(chromium: str,
                                                                tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><title>loadtest bad</title>"
                   '<link rel="icon" href="data:,"></head><body>'
                   "<script>console.error('boom'); undefinedFunction();</script></body></html>")
    with browser(chromium) as devtools:
        page = asyncio.run(open_page(devtools, bad.resolve().as_uri()))
    assert len(page["errors"]) >= 2, page  # the console.error and the ReferenceError
    shot = tmp_path / "bad.png"
    screenshot(chromium, bad.resolve().as_uri(), shot)
    assert not_blank(shot)[0] < 0.01
