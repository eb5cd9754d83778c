"""`loadtest` command line: each subcommand lives in its own module.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only
when chosen, so `loadtest sim` does not pay for the load generator's imports and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("loadtest.sim.cli", "run a simulated vLLM-like engine (OpenAI API) on loopback"),
    "run": ("loadtest.run_cli", "replay a trace or synthetic load; report TTFT, TPOT, goodput"),
    "sweep": ("loadtest.sweep", "run a load at several rates and find the knee"),
    "calibrate": ("loadtest.calibrate", "sweep a pool's engines; write learned thresholds"),
    "gate": ("loadtest.gate", "compare two runs; fail on a performance regression"),
    "overload": ("loadtest.overload", "the demo's engines past saturation, direct and through "
                 "the gateway, side by side"),
    "fleet": ("loadtest.fleet_cli", "a fleet of simulated replicas behind the gateway's "
              "admission, on a virtual clock; --validate against the real benchmark"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="loadtest", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    args = parser.parse_args(argv)  # exits with usage when no known subcommand was given
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args))
