"""`python -m loadtest.vllm --port 8001`: vLLM's OpenAI server (its CPU build) with the tiny
model, in the foreground (exec'd, so a signal to this process reaches vLLM's front end, which
stops its engine core and worker).

Installs vLLM first when it is not cached (tools/engine-vllm, about 2.5 minutes here, once)
and makes the tiny model when it is not cached. `--policy-out FILE` writes a gateway policy for
it first: `gateway serve --policy FILE` then runs the gateway in front of it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loadtest.vllm.model import tiny_model_path
from loadtest.vllm.policy import vllm_policy
from loadtest.vllm.server import (
    SERVED_NAME,
    EngineShape,
    InstallImpossible,
    server_argv,
    server_env,
    vllm_python,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.vllm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded at once")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="--num-gpu-blocks-override: KV blocks of 128 tokens (small: preempts)")
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--threads-bind", default="auto",
                   help='VLLM_CPU_OMP_THREADS_BIND: "auto", or a core ("0", "1")')
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model: twice the decode rate, ~10-50 s more to start")
    p.add_argument("--served-model-name", default=SERVED_NAME)
    p.add_argument("--policy-out", type=Path, default=None,
                   help="write a gateway policy with this engine as its one backend")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="after --: more of vLLM's own flags")
    args = p.parse_args(argv)
    try:
        python = vllm_python()
    except (InstallImpossible, RuntimeError) as exc:
        print(f"vLLM is not available: {exc}", file=sys.stderr)
        return 1
    try:
        model = tiny_model_path()
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    extra = tuple(a for a in args.vllm_args if a != "--")
    shape = EngineShape(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        num_gpu_blocks=args.num_gpu_blocks, kv_cache_gib=args.kv_cache_gib,
                        threads_bind=args.threads_bind, eager=not args.compile, extra=extra)
    if args.policy_out is not None:
        args.policy_out.write_text(vllm_policy([f"http://127.0.0.1:{args.port}"], model,
                                               max_model_len=args.max_model_len,
                                               served_name=args.served_model_name))
        print(f"policy for this engine: {args.policy_out}", file=sys.stderr)
    argv_ = server_argv(python, model, args.port, shape, args.served_model_name)
    os.execve(argv_[0], argv_, server_env(shape))


if __name__ == "__main__":
    raise SystemExit(main())
