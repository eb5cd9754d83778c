"""`gateway demo`: engines for every backend, the gateway, usage printed, all stopped on Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.servers import ROOT, free_port, gateway_cmd, openai_client, wait_http


def test_demo_serves_and_stops_everything(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    text = (ROOT / "policies" / "demo.yaml").read_text()
    text = text.replace("8101", str(ports[0])).replace("8102", str(ports[1]))
    policy = tmp_path / "demo.yaml"
    policy.write_text(text)
    port = free_port()
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(gateway_cmd("demo", "--port", str(port), "--policy", str(policy)),
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, log, timeout=90)
        printed = log.read_text()
        assert f"curl -sN http://127.0.0.1:{port}/v1/chat/completions" in printed
        assert 'OpenAI(base_url="http://127.0.0.1:' in printed
        assert "make overload" in printed  # the one command that shows admission act
        client = openai_client(f"http://127.0.0.1:{port}")
        stream = client.chat.completions.create(
            model="qwen2.5-72b", max_tokens=8, stream=True,
            messages=[{"role": "user", "content": "Hello!"}])
        text_out = "".join(ch.choices[0].delta.content or "" for ch in stream)
        assert text_out.strip()
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.wait(20)
    deadline = time.monotonic() + 10
    for p in ports:  # the engines it started are gone
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", p)) != 0:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError(f"engine on port {p} still running after Ctrl-C")
