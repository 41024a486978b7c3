"""The spread of several `dart-hf bench` runs: speed-up per method and data set, each run, then min / median / max.

    for i in 1 2 3; do dart-hf bench --n 5 --max-new-tokens 128 --out runs/bench-$i; done
    python examples/bench_spread.py runs/bench-1 runs/bench-2 runs/bench-3
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(folders: list[str]) -> None:
    runs = [json.loads((Path(f) / "results.json").read_text()) for f in folders]
    if not all(run["all_equal"] for run in runs):
        print("WARNING: some output differed from plain generate; see the runs' results.md")
    for dataset in runs[0]["datasets"]:
        print(f"\n#### {dataset}\n")
        print("| method | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | min | median | max "
              "| accepted length | plain tokens/s |")
        print("|---|" + "---:|" * (len(runs) + 5))
        for method, name in runs[0]["methods"].items():
            speedups = [run["datasets"][dataset][method]["speedup"] for run in runs]
            accepted = [run["datasets"][dataset][method]["accepted_length"] for run in runs]
            plain = [run["datasets"][dataset]["plain"]["tokens_per_s"] for run in runs]
            print(f"| {name} | " + " | ".join(f"{s:.2f}x" for s in speedups)
                  + f" | {min(speedups):.2f}x | {statistics.median(speedups):.2f}x | {max(speedups):.2f}x"
                  + f" | {min(accepted):.2f}-{max(accepted):.2f} | {min(plain):.1f}-{max(plain):.1f} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
