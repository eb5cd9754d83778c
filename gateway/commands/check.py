"""`gateway check FILE...`: validate policies; print a one-screen summary or what is wrong.

The summary says, per pool, which protections are in force and where each number comes from
(`policy`, `learned`, `planner`, `default`: gateway/admission/thresholds.py), and a pool that
is not protected at all, or only by its KV cache, gets a warning on stderr (the policy is still
valid: exit status 0).

It reads no engine unless asked: with `--engines` it GETs each vLLM's or SGLang's /metrics once
and says what each reports (its KV block size and blocks), and warns where a pool's engines'
block sizes differ from each other (or the pool's `block_size` does not divide theirs), as the
running gateway would say at its first scrape (gateway/signals/blocks.py).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

from gateway.admission.thresholds import Threshold, Thresholds, pool_planner_limits, thresholds_for
from gateway.cost.profiles import CPU, ledger, roofline_gpu
from gateway.policy import Policy, PolicyError, load_policy
from gateway.policy.model import AdmissionSpec, PoolSpec
from gateway.signals.blocks import disagreement
from gateway.signals.engines import EngineSample, parse_engine_metrics
from gateway.state.urls import CLUSTER, SENTINEL, parse_url, state_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files")
    parser.add_argument("--redis-url", default=None,
                        help="also check the state URL `gateway serve --redis-url` would get "
                             "(its form only: nothing is connected to)")
    parser.add_argument("--state-prefix", default="gw", help="and the key prefix")
    parser.add_argument("--engines", action="store_true",
                        help="also read each vLLM or SGLang engine's /metrics once: the KV "
                             "block size and blocks it reports; warn where a pool's differ")


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
        found = warnings(policy)
        if args.engines:
            lines, said = engines_report(policy, read_engines(policy))
            print("\n".join(lines))
            found += said
        for pool, warning in found:
            print(f"{path}: pools.{pool}: warning: {warning}", file=sys.stderr)
    return 1 if failed else 0


# An engine's reading: its sample, or why there is none.
Reading = EngineSample | str


def _read(url: str, engine: str, timeout_s: float) -> Reading:
    """One engine's /metrics, parsed as the gateway's scraper parses it."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
            page: bytes = resp.read()
    except urllib.error.HTTPError as exc:
        return f"not read (HTTP {exc.code})"
    except urllib.error.URLError as exc:
        return f"not read ({exc.reason})"
    except (OSError, ValueError) as exc:  # timed out, a broken answer
        return f"not read ({exc})"
    return parse_engine_metrics(page.decode("utf-8", "replace"), engine, time.monotonic())


def read_engines(policy: Policy) -> dict[str, dict[str, Reading]]:
    """Each vLLM or SGLang backend's /metrics, read once as the gateway scrapes it, by pool."""
    timeout = max(2.0, policy.signals.scrape_timeout_s)
    return {name: {b.name: _read(b.url, pool.engine, timeout) for b in pool.backends}
            for name, pool in policy.pools.items() if pool.engine in ("vllm", "sglang")}


def engines_report(policy: Policy, readings: dict[str, dict[str, Reading]]
                   ) -> tuple[list[str], list[tuple[str, str]]]:
    """(lines for stdout, (pool, warning) pairs) of what `read_engines` found."""
    lines = ["  engines (--engines):" if readings
             else "  engines (--engines): no vLLM or SGLang pool to read"]
    said: list[tuple[str, str]] = []
    for name, backends in readings.items():
        pool = policy.pools[name]
        lines.append(f"    {name}:")
        sizes: dict[str, int] = {}
        for backend, r in backends.items():
            if isinstance(r, str):
                lines.append(f"      - {backend}: {r}")
                continue
            if r.block_size is not None:
                sizes[backend] = r.block_size
            block = (f"KV blocks of {r.block_size} tokens" if r.block_size is not None
                     else "no KV block size reported")
            count = f", {r.num_gpu_blocks:,} blocks" if r.num_gpu_blocks is not None else ""
            lines.append(f"      - {backend}: {block}{count}")
        words = disagreement(pool.block_size, sizes)
        if words is None:
            continue
        # Engines that differ from each other, or blocks the pool's does not divide, cost
        # accuracy: a warning. One engine size the pool's divides is followed exactly: a note.
        engine_sizes = set(sizes.values())
        if len(engine_sizes) > 1 or max(engine_sizes) % pool.block_size:
            said.append((name, words))
        else:
            lines.append(f"      note: {words}")
    return lines, said


def describe_state(url: str) -> str:
    target = parse_url(url)
    nodes = ", ".join(f"{host}:{port}" for host, port in target.nodes)
    tls = ", over TLS" if target.tls else ""
    if target.kind == CLUSTER:
        return f"Redis Cluster, found from {nodes}{tls}"
    if target.kind == SENTINEL:
        auth = ", Sentinels asked with a password" if target.sentinel_password else ""
        return (f"primary {target.service!r} (db {target.db}) named by the Sentinels at "
                f"{nodes}{tls}{auth}")
    return "one Redis" if target.url else "memory (this process only)"


def summarise(policy: Policy) -> str:
    lines = ["  models:"]
    for m in policy.models:
        arch = m.architecture.resolve() if m.architecture else None
        detail = (f"{arch.name}, {arch.num_layers} layers, {arch.num_kv_heads} KV heads, "
                  f"KV {arch.kv_bytes_per_token(m.kv_cache_dtype):,} B/token"
                  if arch else "no architecture")
        served = f" (engines call it {m.served_name})" if m.served_name else ""
        encoder = " (the Hugging Face encoder only)" if m.encoder == "huggingface" else ""
        lines.append(f"    {m.name}{served}: tokenizer {m.tokenizer}{encoder}; {detail}")
    lines.append("  pools:")
    for name, pool in policy.pools.items():
        hardware = "on CPUs" if pool.gpu == CPU else f"{pool.gpu} TP={pool.tp}"
        lines.append(f"    {name}: {pool.engine}, models {', '.join(pool.models)}, "
                     f"max_model_len {pool.max_model_len}, {hardware}")
        for b in pool.backends:
            lines.append(f"      - {b.name}: {b.url}")
        lines.append("      protections (source):")
        lines.extend(f"        {line}" for line in protections(policy, pool))
    s, u, h = policy.server, policy.upstream, policy.health
    lines.append(f"  limits: body {s.max_body_bytes:,} B, body timeout {s.body_timeout_s:g}s, "
                 f"prompt {s.max_prompt_chars:,} chars; default max_tokens "
                 f"{policy.defaults.max_tokens}")
    lines.append(f"  upstream: connect {u.connect_timeout_s:g}s, read {u.read_timeout_s:g}s, "
                 f"{u.max_connections} connections, "
                 + ("the gateway's own client (aiohttp for https)" if u.client == "native"
                    else "aiohttp's client") + "; health: probe every "
                 f"{h.probe_interval_s:g}s, eject after {h.failure_threshold} failures for "
                 f"{h.cooldown_s:g}s")
    slo = policy.defaults.slo
    lines.append("  slo (defaults.slo): " + (
        f"TTFT P95 {slo.ttft_p95_s:g}s, TPOT P95 {slo.tpot_p95_s * 1000:g}ms; the planner "
        "derives each pool's first limits from it" if slo is not None
        else "none: no limits from the planner"))
    return "\n".join(lines)


def _src(t: Threshold, why: str = "") -> str:
    return f"({t.source}: {why})" if why and t.source == "planner" else f"({t.source})"


def _kv_capacity(policy: Policy, pool: PoolSpec) -> tuple[int | None, str]:
    """KV blocks per backend and where that number comes from, as admission starts with it."""
    if pool.kv_blocks is not None:
        return pool.kv_blocks, "policy"
    model = policy.model(pool.models[0])
    gpu = roofline_gpu(pool.gpu)  # None on CPUs: no ledger
    if model is not None and model.architecture is not None and gpu is not None:
        led = ledger(model.architecture.resolve(), gpu, pool.tp, model.dtype,
                     model.kv_cache_dtype, block_size=pool.block_size)
        return led.num_gpu_blocks, "planner's ledger"
    return None, ""


def protections(policy: Policy, pool: PoolSpec) -> list[str]:
    """One line per protection of `pool`: what is in force, its number and its source."""
    a = pool.admission
    if not a.enabled:
        return ["none: admission disabled (every request is forwarded)"]
    th = thresholds_for(pool, policy)
    plan = pool_planner_limits(pool, policy)
    why = plan.explain() if plan is not None else {}
    out = []
    if a.shadow:
        out.append("shadow mode: decisions are counted, nothing is enforced")
    if a.mode == "static":
        waiting = th.waiting_max.value
        kv = th.kv_usage_max
        out.append(f"static rule: shed when every engine reports more than "
                   f"{5 if waiting is None else waiting:g} waiting "
                   f"({th.waiting_max.source if waiting is not None else 'default'}) or KV "
                   f"usage over {kv.value if kv.source != 'default' else 0.8:g} "
                   f"({kv.source})")
        return out
    if pool.engine == "llamacpp":
        out.append("slots: each engine takes as many requests as it has slots (llama.cpp "
                   "/props total_slots, once scraped); the rest wait in the gateway's queue")
        return out + _limits(th, why, a)
    blocks, where = _kv_capacity(policy, pool)
    kv = th.kv_usage_max
    engine_reports = pool.engine != "openai" and pool.kv_blocks is None
    if blocks is not None:
        replaced = "; the engines' own reports replace it" if engine_reports else ""
        out.append(f"KV reservations: {blocks:,} blocks of {pool.block_size} per engine "
                   f"({where}{replaced}), up to kv_usage_max {kv.value:g} ({kv.source})")
    elif engine_reports:
        unplanned = "engines on CPUs" if pool.gpu == CPU else "no architecture"
        out.append(f"KV reservations: from the engines' own reports once scraped ({unplanned} "
                   f"and no kv_blocks for a planned figure), up to kv_usage_max "
                   f"{kv.value:g} ({kv.source})")
    if pool.gpu == CPU:
        out.append("roofline: none for engines on CPUs (gpu: cpu): no planned KV capacity, "
                   "prefill backlog or in-flight tokens; capacity comes from the engines' "
                   "reports, those limits from `loadtest calibrate` on these engines")
    if pool.engine == "vllm":
        # Only the engines know their block size (16 on a GPU by default, 128 on a CPU):
        # check never reaches them, so it says the rule and the first scrape says the facts.
        out.append(f"KV blocks: reservations and predicted cached tokens in whole blocks of "
                   f"the engines' own size (vllm:cache_config_info) once scraped, until then "
                   f"of block_size {pool.block_size}; engines that differ from each other or "
                   f"from it are logged then (gateway_engine_kv_block_size_tokens), and said "
                   f"now by `gateway check --engines`")
    return out + _limits(th, why, a)


def _limits(th: Thresholds, why: dict[str, str], a: AdmissionSpec) -> list[str]:
    """The limits beside the KV (or slot) reservations, and the queue."""
    out = []
    for name, label, unit in (
            ("prefill_tokens_max", "prefill backlog", "tokens per engine"),
            ("inflight_tokens_max", "in-flight tokens", "tokens in the pool"),
            ("waiting_max", "engine queue", "waiting per engine")):
        t: Threshold = getattr(th, name)
        if t.value is not None:
            out.append(f"{label}: {t.value:,.0f} {unit} {_src(t, why.get(name, ''))}")
    ttft, tpot = th.ttft_p99_max_s, th.tpot_p99_max_s
    if ttft.value is not None or tpot.value is not None:
        lines = [f"TTFT P99 {ttft.value:g}s {_src(ttft, why.get('ttft_p99_max_s', ''))}"
                 if ttft.value is not None else "",
                 f"TPOT P99 {tpot.value * 1000:g}ms {_src(tpot, why.get('tpot_p99_max_s', ''))}"
                 if tpot.value is not None else ""]
        out.append("latency guard: " + ", ".join(x for x in lines if x))
    q = th.queue_wait_max_s
    out.append(f"queue: {a.queue_size} waiting at most {q.value:g}s "
               f"{_src(q, why.get('queue_wait_max_s', ''))}" if a.queue_size
               else "queue: none (queue_size 0: what does not fit now is refused)")
    return out


def warnings(policy: Policy) -> list[tuple[str, str]]:
    """(pool, warning) for each pool left unprotected, or guarded only by its KV cache."""
    out = []
    for name, pool in policy.pools.items():
        a = pool.admission
        if not a.enabled:
            out.append((name, "no protection in force: admission is disabled"))
            continue
        if a.shadow:
            out.append((name, "no protection in force: shadow mode enforces nothing"))
            continue
        if a.mode == "static":
            continue
        th = thresholds_for(pool, policy)
        limits = [th.prefill_tokens_max, th.inflight_tokens_max, th.waiting_max,
                  th.ttft_p99_max_s, th.tpot_p99_max_s]
        kv_known = _kv_capacity(policy, pool)[0] is not None or pool.engine != "openai"
        if pool.gpu == CPU and th.prefill_tokens_max.value is None \
                and th.inflight_tokens_max.value is None:
            out.append((name, "its engines run on CPUs (gpu: cpu), which have no roofline: "
                        "no prefill backlog or in-flight token limits until `loadtest "
                        "calibrate` learns them on these engines"
                        + ("" if kv_known else "; and no KV capacity known (give kv_blocks)")))
        elif not any(t.value is not None for t in limits) and pool.engine == "llamacpp":
            out.append((name, "no protection in force beyond the engines' slots and the "
                        "queue deadline: run `loadtest calibrate` for latency limits"))
        elif not any(t.value is not None for t in limits):
            out.append((name, "no protection in force beyond the KV cache: give its model an "
                        "architecture and keep defaults.slo (limits from the planner), or run "
                        "`loadtest calibrate`" if kv_known else
                        "no protection in force: no KV capacity known (no architecture, no "
                        "kv_blocks, an engine that reports none) and no limits; give its "
                        "model an architecture, or run `loadtest calibrate`"))
    return out
