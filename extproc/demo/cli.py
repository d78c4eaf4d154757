"""`extproc demo`: the demo parses its own options, so `extproc` only hands it the rest of the line."""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(sub: Any) -> None:
    """Add `demo` to `extproc`'s subcommands (the demo's imports stay lazy)."""
    demo = sub.add_parser("demo", add_help=False,
                          help="the heterogeneous before/after demo (--help for its options)")
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extproc.demo.__main__ import main

    return main(args.rest)
