"""`gateway demo`: simulated engines for every backend of the demo policy, and the gateway.

Each backend URL of the policy (all on loopback) gets a `loadtest sim` process with the pool's
GPU, TP and the model's architecture, so the demo saturates like the real fleet would. The
gateway runs in this process; Ctrl-C stops it and every engine it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from gateway.commands.serve import serve
from gateway.policy import Policy, PolicyError, load_policy

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "demo.yaml"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    parser.add_argument("--policy", default=str(DEFAULT_POLICY), metavar="FILE",
                        help="policy whose loopback backends are simulated")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="slow the simulated engines' time by this factor")


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    problem = _check_ports(policy, args.port, args.policy)
    if problem:
        print(f"gateway demo: {problem}", file=sys.stderr)
        return 1
    engines = _start_engines(policy, args.time_scale)
    try:
        if not _wait_engines(policy, engines):
            return 1
        _print_usage(policy, args.port)
        serve(policy, "127.0.0.1", args.port, policy_path=args.policy)
    finally:
        _stop(engines)
        print("gateway demo: stopped the gateway and its simulated engines", file=sys.stderr)
    return 0


def _backends(policy: Policy) -> list[tuple[str, str, str, int]]:
    """(pool, backend, host, port) of every backend."""
    out = []
    for pool_name, pool in policy.pools.items():
        for b in pool.backends:
            parts = urlsplit(b.url)
            out.append((pool_name, b.name, parts.hostname or "", parts.port or 80))
    return out


def _check_ports(policy: Policy, gateway_port: int, policy_path: str) -> str | None:
    for pool, name, host, _ in _backends(policy):
        if host not in LOOPBACK:
            return (f"backend {pool}/{name} is at {host}; the demo only simulates engines on "
                    "loopback")
    if not _bindable(gateway_port):
        return (f"port {gateway_port} (the gateway) is already in use; stop what holds it (a "
                "previous demo?) or pick another port with --port")
    for pool, name, _, port in _backends(policy):
        if not _bindable(port):
            return (f"port {port} (engine {pool}/{name}, its url in {policy_path}) is already "
                    "in use; stop what holds it (a previous demo?), or move the engines: copy "
                    "the policy, change its backend urls' ports, and pass the copy with "
                    "--policy FILE (--port moves only the gateway)")
    return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        # As uvicorn and the engines bind: a connection of a previous run lingering in
        # TIME_WAIT does not make the port busy for them, so it must not for this check.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_engines(policy: Policy, time_scale: float) -> list[subprocess.Popen[bytes]]:
    procs = []
    for pool_name, pool in policy.pools.items():
        for b in pool.backends:
            model = policy.model(pool.models[0])
            assert model is not None
            arch = model.architecture.profile if model.architecture else None
            port = urlsplit(b.url).port or 80
            if pool.engine == "llamacpp":
                # A real engine: llama.cpp's server with a tiny random model (built and made
                # on first use, then cached; loadtest/llamacpp/).
                print(f"gateway demo: engine {pool_name}/{b.name} on 127.0.0.1:{port} "
                      "(llama-server, tiny random Qwen2)", file=sys.stderr)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "loadtest.llamacpp", "--port", str(port),
                     "--slot-context", str(pool.max_model_len),
                     "--served-model-name", model.upstream_name, "--quiet"],
                    start_new_session=True, preexec_fn=_die_with_parent))
                continue
            cmd = [sys.executable, "-m", "loadtest", "sim",
                   "--model", arch or "qwen2.5-72b", "--gpu", pool.gpu, "--tp", str(pool.tp),
                   "--port", str(port), "--served-model-name", model.upstream_name,
                   "--max-model-len", str(pool.max_model_len),
                   "--tokenizer", model.tokenizer, "--time-scale", str(time_scale)]
            if model.chat_template is not None:
                # The engine renders with the template the gateway counts with, so they agree.
                cmd += ["--chat-template", model.chat_template]
            print(f"gateway demo: engine {pool_name}/{b.name} on 127.0.0.1:{port} "
                  f"(simulated {arch} on {pool.tp} x {pool.gpu})", file=sys.stderr)
            # Own process group: Ctrl-C in the terminal reaches us, and we stop them in order;
            # and should we die without cleaning up, the kernel stops them (Linux).
            procs.append(subprocess.Popen(cmd, start_new_session=True,
                                          preexec_fn=_die_with_parent))
    return procs


def _die_with_parent() -> None:
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _wait_engines(policy: Policy, procs: list[subprocess.Popen[bytes]],
                  timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    for (pool, name, _, port), proc in zip(_backends(policy), procs, strict=True):
        while True:
            if proc.poll() is not None:
                print(f"gateway demo: engine {pool}/{name} exited ({proc.returncode})",
                      file=sys.stderr)
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"gateway demo: engine {pool}/{name} did not start in {timeout:g}s",
                          file=sys.stderr)
                    return False
                time.sleep(0.1)
    return True


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def _print_usage(policy: Policy, port: int) -> None:
    model = policy.models[0].name
    base = f"http://127.0.0.1:{port}"
    print(f"""
Gateway on {base} (policy: {len(policy.pools)} pool(s), model {model}). Try:

  curl -sN {base}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "max_tokens": 32,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  .venv/bin/python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="{model}", max_tokens=32, stream=True,
    messages=[{{"role": "user", "content": "Hello!"}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

See admission act (in another terminal; about a minute, with engines of its own): the demo's
engines past saturation, direct and through the gateway, side by side, plots in overload.html:

  make overload

Readiness: {base}/readyz   Metrics: {base}/metrics   Stop: Ctrl-C
""", flush=True)
