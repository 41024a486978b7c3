"""Benchmark DART against plain `generate`, prompt lookup and chain drafting: the same as `dart-hf bench`.

    python examples/benchmark.py --head model_cards/smollm2-135m-instruct-dart --n 5 --max-new-tokens 128
    python examples/benchmark.py --synthetic --out runs/synthetic      # CUDA only (see examples/gpu_check.sh)

Every option of `dart-hf bench --help` works here. Exit status: 0 when every output equals plain generate,
3 when some output differs, 2 when the head is missing or --synthetic has no GPU.
"""

from __future__ import annotations

import argparse
import sys

from dart_hf.tools import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmark.py")
    bench.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
