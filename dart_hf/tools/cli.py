"""`dart-hf`: one command, one subcommand per job (each module registers its own with `add_cli`)."""

from __future__ import annotations

import argparse
import sys

from . import bench, convert, demo, hub
from ..training import ngram_corpus, pipeline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dart-hf", description="DART speculative decoding for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (demo, pipeline, ngram_corpus, bench, convert, hub):
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
