"""`python -m loadtest.llamacpp --port 8001`: llama.cpp's server with the tiny model, in the
foreground (exec'd, so a signal to this process reaches llama-server itself).

Builds llama-server first when it is not cached (tools/engine-llamacpp, about ten minutes on
two cores, once) and makes the tiny model when it is not cached. `gateway demo` runs it for
the backends of pools declared `engine: llamacpp` (policies/demo-llamacpp.yaml).
"""

from __future__ import annotations

import argparse
import os
import sys

from loadtest.llamacpp.model import tiny_model_path
from loadtest.llamacpp.server import (
    SERVED_NAME,
    BuildImpossible,
    EngineShape,
    llama_server_binary,
    server_argv,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.llamacpp", description=__doc__)
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--slots", type=int, default=4, help="-np: requests decoded at once")
    p.add_argument("--slot-context", type=int, default=4096, help="tokens of context per slot")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--served-model-name", default=SERVED_NAME)
    p.add_argument("--quiet", action="store_true", help="log only warnings and errors")
    args = p.parse_args(argv)
    try:
        binary = llama_server_binary()
    except (BuildImpossible, RuntimeError) as exc:
        print(f"llama-server is not available: {exc}", file=sys.stderr)
        return 1
    shape = EngineShape(slots=args.slots, slot_context=args.slot_context, threads=args.threads)
    try:
        model = tiny_model_path()
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    argv_ = server_argv(binary, model, args.port, shape, args.served_model_name)
    if args.quiet:
        argv_ += ["--log-verbosity", "2"]  # common/arg.cpp: 2 = warnings and errors
    os.execv(argv_[0], argv_)


if __name__ == "__main__":
    raise SystemExit(main())
