"""`gateway check FILE...`: validate policies; print a one-screen summary or what is wrong."""

from __future__ import annotations

import argparse
import sys

from gateway.policy import Policy, PolicyError, load_policy
from gateway.state.urls import CLUSTER, SENTINEL, parse_url, state_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files")
    parser.add_argument("--redis-url", default=None,
                        help="also check the state URL `gateway serve --redis-url` would get "
                             "(its form only: nothing is connected to)")
    parser.add_argument("--state-prefix", default="gw", help="and the key prefix")


def run(args: argparse.Namespace) -> int:
    problem = state_problem(args.redis_url, args.state_prefix)
    if problem:
        print(f"gateway check: {problem}", file=sys.stderr)
        return 2
    if args.redis_url:
        print(f"state: {describe_state(args.redis_url)}")
    failed = False
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            print(exc.render(), file=sys.stderr)
            failed = True
            continue
        print(f"{path}: ok")
        print(summarise(policy))
    return 1 if failed else 0


def describe_state(url: str) -> str:
    target = parse_url(url)
    nodes = ", ".join(f"{host}:{port}" for host, port in target.nodes)
    if target.kind == CLUSTER:
        return f"Redis Cluster, found from {nodes}"
    if target.kind == SENTINEL:
        return f"primary {target.service!r} (db {target.db}) named by the Sentinels at {nodes}"
    return "one Redis" if target.url else "memory (this process only)"


def summarise(policy: Policy) -> str:
    lines = ["  models:"]
    for m in policy.models:
        arch = m.architecture.resolve() if m.architecture else None
        detail = (f"{arch.name}, {arch.num_layers} layers, {arch.num_kv_heads} KV heads, "
                  f"KV {arch.kv_bytes_per_token(m.kv_cache_dtype):,} B/token"
                  if arch else "no architecture")
        served = f" (engines call it {m.served_name})" if m.served_name else ""
        lines.append(f"    {m.name}{served}: tokenizer {m.tokenizer}; {detail}")
    lines.append("  pools:")
    for name, pool in policy.pools.items():
        lines.append(f"    {name}: {pool.engine}, models {', '.join(pool.models)}, "
                     f"max_model_len {pool.max_model_len}, {pool.gpu} TP={pool.tp}")
        for b in pool.backends:
            lines.append(f"      - {b.name}: {b.url}")
    s, u, h = policy.server, policy.upstream, policy.health
    lines.append(f"  limits: body {s.max_body_bytes:,} B, body timeout {s.body_timeout_s:g}s, "
                 f"prompt {s.max_prompt_chars:,} chars; default max_tokens "
                 f"{policy.defaults.max_tokens}")
    lines.append(f"  upstream: connect {u.connect_timeout_s:g}s, read {u.read_timeout_s:g}s, "
                 f"{u.max_connections} connections; health: probe every "
                 f"{h.probe_interval_s:g}s, eject after {h.failure_threshold} failures for "
                 f"{h.cooldown_s:g}s")
    return "\n".join(lines)
