"""`gateway serve --policy FILE`: run the gateway under uvicorn (uvloop + httptools).

`--workers N` runs N processes on one port (gateway/serving/workers.py says how they share
admission state and metrics).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

from gateway.api.admin import PARENT_ENV
from gateway.app import create_app
from gateway.observe.accesslog import configure_logging
from gateway.policy import Policy, PolicyError, load_policy
from gateway.serving import server, workers
from gateway.state.urls import state_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", required=True, metavar="FILE", help="policy YAML")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--admin-port", type=int, default=None,
                        help="serve /admin/* on this port only (default: on --port)")
    # Not --host: a container binds --host 0.0.0.0 for its callers, and the admin API
    # should not follow it there unless asked.
    parser.add_argument("--admin-host", default="127.0.0.1",
                        help="address of --admin-port (default 127.0.0.1)")
    parser.add_argument("--redis-url", default=None,
                        help="share reservations and quotas between replicas through Redis: "
                             "redis://host:port/db, redis+cluster://host:port,host:port or "
                             "redis+sentinel://host:port,host:port/service_name")
    parser.add_argument("--state-prefix", default="gw",
                        help="prefix of this deployment's Redis keys (default gw)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="processes on one port (default 1); N > 1 needs --redis-url, "
                             "and /metrics then adds up all workers")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    problem = _workers_problem(args) or state_problem(args.redis_url, args.state_prefix)
    if problem:
        print(f"gateway serve: {problem}", file=sys.stderr)
        return 2
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    if args.workers > 1:
        return workers.run(args.workers, args.host, args.port, worker_main, {
            "host": args.host, "port": args.port, "log_level": args.log_level,
            "redis_url": args.redis_url, "state_prefix": args.state_prefix,
            "policy_path": args.policy})
    serve(policy, args.host, args.port, args.log_level, args.redis_url, args.state_prefix,
          policy_path=args.policy, admin_port=args.admin_port, admin_host=args.admin_host)
    return 0


def _workers_problem(args: argparse.Namespace) -> str | None:
    n = args.workers
    if n < 1:
        return f"--workers must be at least 1, got {n}"
    if n > 1 and not args.redis_url:
        return (f"--workers {n} needs --redis-url: each worker process admits requests on its "
                "own, so KV reservations must be shared through Redis (with memory state "
                f"{n} workers would together admit {n} times the budget). Pass --redis-url "
                "redis://HOST:6379/0, or run one worker per replica.")
    if n > 1 and args.admin_port is not None:
        return (f"--admin-port serves one process; with --workers {n} reload the policy with "
                "SIGHUP to the parent process, which passes it to every worker.")
    return None


def serve(policy: Policy, host: str, port: int, log_level: str = "info",
          redis_url: str | None = None, state_prefix: str = "gw",
          policy_path: str | None = None, admin_port: int | None = None,
          sockets: list[socket.socket] | None = None, admin_host: str = "127.0.0.1") -> None:
    configure_logging(log_level)
    app = create_app(policy, redis_url=redis_url, state_prefix=state_prefix,
                     policy_path=policy_path, admin_routes=admin_port is None)
    limits = policy.server
    server.run(app, host, port,
               limits=server.ConnectionLimits(limits.max_header_bytes, limits.header_timeout_s,
                                              limits.keep_alive_timeout_s,
                                              limits.max_body_bytes),
               max_concurrency=limits.max_concurrent_requests * 2 + 64,
               admin_app=app.admin_app() if admin_port is not None else None,
               admin_host=admin_host, admin_port=admin_port, on_sighup=app.reload,
               sockets=sockets)


def worker_main(sock: socket.socket, serve_kwargs: dict[str, Any]) -> None:
    """One worker of `--workers N` (gateway/serving/workers.py starts it)."""
    # The parent checked this file a moment ago; a worker that cannot load it must not serve.
    policy = load_policy(serve_kwargs["policy_path"])
    # POST /admin/reload reaches one worker; it asks the parent to reload them all.
    os.environ[PARENT_ENV] = str(os.getppid())
    serve(policy, sockets=[sock], **serve_kwargs)
