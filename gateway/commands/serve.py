"""`gateway serve --policy FILE`: run the gateway under uvicorn (uvloop + httptools)."""

from __future__ import annotations

import argparse
import sys

from gateway.policy import Policy, PolicyError, load_policy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", required=True, metavar="FILE", help="policy YAML")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--redis-url", default=None,
                        help="share state between replicas through this Redis")
    parser.add_argument("--state-prefix", default="gw",
                        help="prefix of this deployment's Redis keys (default gw)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
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
