"""`gateway serve --policy FILE`: run the gateway under uvicorn (uvloop + httptools).

`--workers N` runs N processes on one port (uvicorn's supervisor). Two things must then be
shared, or each worker would see only its own part of the truth:

- admission: each worker admits on its own, so KV reservations must live in Redis
  (`--redis-url`); with per-process memory state N workers would admit N times the budget;
- metrics: a scrape reaches one worker at random, so every worker writes its samples to files
  in a shared directory (prometheus_client's multiprocess mode) and `/metrics` sums counters
  and histograms over all of them. Gauges say how they combine in `gateway/metrics.py`.

One process per replica (a container, a pod) behind shared Redis is the simpler way to scale
out and keeps each `/metrics` exact without files; `--workers` is for using more cores per
replica. docs/operations.md compares the two.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

from gateway.policy import Policy, PolicyError, load_policy

# The environment carries the worker's settings: uvicorn spawns each worker as a fresh
# interpreter that imports the app factory by name.
WORKER_ENV = "GATEWAY_WORKER_CONFIG"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", required=True, metavar="FILE", help="policy YAML")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--redis-url", default=None,
                        help="share state between replicas through this Redis")
    parser.add_argument("--state-prefix", default="gw",
                        help="prefix of this deployment's Redis keys (default gw)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="worker processes on one port (default 1); N > 1 needs "
                             "--redis-url, and /metrics then sums over all workers")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print(f"gateway serve: --workers must be at least 1, got {args.workers}",
              file=sys.stderr)
        return 2
    if args.workers > 1 and not args.redis_url:
        print(f"gateway serve: --workers {args.workers} needs --redis-url: each worker process "
              "admits requests on its own, so KV reservations must be shared through Redis "
              f"(with memory state {args.workers} workers would together admit "
              f"{args.workers} times the budget). Pass --redis-url redis://HOST:6379/0, or run "
              "one worker per replica.", file=sys.stderr)
        return 2
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    if args.workers > 1:
        serve_workers(args.policy, args.host, args.port, args.workers, args.log_level,
                      args.redis_url, args.state_prefix)
    else:
        serve(policy, args.host, args.port, args.log_level, args.redis_url, args.state_prefix)
    return 0


def serve(policy: Policy, host: str, port: int, log_level: str = "info",
          redis_url: str | None = None, state_prefix: str = "gw") -> None:
    import uvicorn

    from gateway.accesslog import configure_logging
    from gateway.app import create_app

    configure_logging(log_level)
    app = create_app(policy, redis_url=redis_url, state_prefix=state_prefix)
    uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="on",
                timeout_graceful_shutdown=5, backlog=4096)


def serve_workers(policy_path: str, host: str, port: int, workers: int, log_level: str,
                  redis_url: str, state_prefix: str) -> None:
    import uvicorn

    own_dir = None
    metrics_dir = os.environ.get(MULTIPROC_ENV)
    if metrics_dir:
        # Files left by an earlier run would add its counts to this one's.
        os.makedirs(metrics_dir, exist_ok=True)
        for path in glob.glob(os.path.join(metrics_dir, "*.db")):
            os.remove(path)
    else:
        metrics_dir = own_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    # Set before uvicorn spawns the workers: prometheus_client picks its file-backed values
    # when a worker first imports it.
    os.environ[MULTIPROC_ENV] = metrics_dir
    os.environ[WORKER_ENV] = json.dumps({
        "policy": os.path.abspath(policy_path), "redis_url": redis_url,
        "state_prefix": state_prefix, "log_level": log_level})
    try:
        uvicorn.run("gateway.commands.serve:worker_app", factory=True, workers=workers,
                    host=host, port=port, loop="uvloop", http="httptools",
                    log_level="warning", access_log=False, lifespan="on",
                    timeout_graceful_shutdown=5, backlog=4096)
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def worker_app() -> object:
    """The app of one `--workers` process, built from the settings the parent left."""
    from gateway.accesslog import configure_logging
    from gateway.app import create_app

    config = json.loads(os.environ[WORKER_ENV])
    configure_logging(config["log_level"])
    # The parent validated this file a moment ago; a worker that cannot load it must not serve.
    policy = load_policy(config["policy"])
    return create_app(policy, redis_url=config["redis_url"],
                      state_prefix=config["state_prefix"])
