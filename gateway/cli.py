"""`gateway` command line: serve, check, demo, plan.

Each subcommand's heavy imports happen only when it runs, so `gateway check` is quick.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help); each module has add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.commands.serve", "run the gateway with a policy file"),
    "check": ("gateway.commands.check", "validate policy files and summarise them"),
    "demo": ("gateway.commands.demo", "run the demo: simulated engines and the gateway"),
    "plan": ("gateway.planner.plan", "capacity planner: weights, KV budget, concurrency, TP "
             "choices"),
    "hash-key": ("gateway.commands.hash_key", "print the SHA-256 digest of an API key for the "
                 "policy"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="gateway", description="Admission-control gateway for LLM inference.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)  # exits with usage when no known subcommand was given
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `gateway check FILE | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
