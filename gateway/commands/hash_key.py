"""`gateway hash-key`: the SHA-256 digest to put in a policy for an API key.

Keys never go into the policy in plain text. Reads the key from standard input (so it stays
out of shell history), or makes a new random one with --new and prints both.
"""

from __future__ import annotations

import argparse
import secrets
import sys

from gateway.tenancy.auth import hash_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new", action="store_true",
                        help="generate a new random key and print it with its digest")


def run(args: argparse.Namespace) -> int:
    if args.new:
        key = "sk-gw-" + secrets.token_urlsafe(32)
        print(f"key:    {key}")
        print(f"sha256: {hash_key(key)}")
        return 0
    if sys.stdin.isatty():
        print("key (not echoed): ", end="", file=sys.stderr, flush=True)
        import getpass

        key = getpass.getpass("")
    else:
        key = sys.stdin.readline()
    key = key.strip()
    if not key:
        print("gateway hash-key: no key given on standard input (or use --new)",
              file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0
