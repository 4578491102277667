"""The `flexserve` command: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from flexserve.entrypoints.cli.bench import add_bench_parser
from flexserve.entrypoints.cli.finetune_plan import add_finetune_plan_parser
from flexserve.entrypoints.cli.profile import add_profile_parser
from flexserve.entrypoints.cli.serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexserve", description="Serve LLMs with an OpenAI-compatible API.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(commands)
    add_bench_parser(commands)
    add_finetune_plan_parser(commands)
    add_profile_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "info").upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.handler(args)
    except ValueError as e:  # a bad option or model: a message, not a traceback
        parser.exit(2, f"flexserve {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
