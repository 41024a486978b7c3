"""Held-out accepted length against the distinct response tokens a head has been trained on, as a PNG.

Reads a JSON list of measured points, one per head (`{"head", "distinct_tokens", "humaneval", "sharegpt", ...}`,
the numbers `examples/tune_tree_search.py` printed for each head on the same texts and settings) and plots both data
sets, with the goal lines when the file gives them (`{"points": [...], "goals": {"humaneval": 3.0, ...}}`).

    python examples/plot_data_curve.py model_cards/smollm2-135m-instruct-dart/data_curve.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("points", help="JSON file of measured points")
    ap.add_argument("--out", help="PNG path (default: the JSON path with .png)")
    args = ap.parse_args()
    record = json.loads(Path(args.points).read_text())
    points = sorted(record["points"], key=lambda p: p["distinct_tokens"])
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, color in (("humaneval", "tab:blue"), ("sharegpt", "tab:orange")):
        ax.plot([p["distinct_tokens"] / 1e3 for p in points], [p[name] for p in points], marker="o", color=color,
                label=f"{name} (held-out)")
        goal = record.get("goals", {}).get(name)
        if goal is not None:
            ax.axhline(goal, color=color, linestyle=":", linewidth=1, label=f"{name} goal {goal}")
    for p in points:
        ax.annotate(p["head"], (p["distinct_tokens"] / 1e3, p["humaneval"]), textcoords="offset points",
                    xytext=(4, -12), fontsize=7)
    ax.set(xlabel="distinct response tokens trained on (thousands)", ylabel="mean accepted length")
    ax.set_title(record.get("title", "held-out accepted length against training data"), fontsize=9)
    ax.margins(x=0.2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.out or Path(args.points).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
