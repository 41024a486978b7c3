"""`dart-hf calibrate`: measure a target's verify-cost curve on this device ahead of time and show where it lives.

The cost-aware node budget (`dart_hf.core.budget`) needs the curve; without a calibration the first `generate`
with `dart_node_budget="auto"` measures it on the spot, on whatever else the machine is doing then. Calibrating on
a quiet machine, or again after a run reported the cached curve stale, keeps that measurement out of generation.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

DTYPES = ("float32", "bfloat16", "float16")


def run(args: argparse.Namespace) -> int:
    """Load the target, load or measure its verify-cost curve, print it. Exit status 0, or 1 when the measurement
    failed its checks on every attempt (the curve is then kept for an hour only)."""
    from ..core.budget import verify_cost
    from .assets import load_target

    if args.repeats < 1:
        raise SystemExit("dart-hf calibrate: --repeats must be >= 1")
    if args.past_len is not None and args.past_len < 1:
        raise SystemExit("dart-hf calibrate: --past-len must be >= 1")
    target, _ = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device,
                            attn_implementation=args.attn)
    started = time.time()
    cost = verify_cost(target, sizes=args.sizes, past_len=args.past_len, repeats=args.repeats,
                       refresh=args.force, verbose=True)
    measured_now = cost.record.get("measured_at", 0) >= started
    if args.json:
        print(json.dumps(cost.to_dict(), indent=1, default=str))
        return 0 if cost.record.get("sanity", {}).get("ok", True) else 1
    key = cost.key or {}
    print(f"verify cost of {key.get('name')} on {key.get('device_name')} ({key.get('dtype')}, "
          f"{key.get('attn_implementation')}), after {cost.record.get('past_len')} cached tokens")
    one = cost.seconds[0]
    print(f"{'tokens':>7} {'ms':>9} {'x ' + str(cost.sizes[0]) + ' token(s)':>14}")
    for n, s in zip(cost.sizes, cost.seconds):
        print(f"{n:>7} {1e3 * s:>9.2f} {s / one:>14.2f}")
    sanity = cost.record.get("sanity", {})
    state = "measured now" if measured_now else f"cached, measured {cost.record.get('measured_at_utc', '?')}"
    print(f"{state}; stored in {cost.path}")
    if cost.record.get("confirmed"):
        print("confirmed: a re-measurement agreed with the curve a run had found stale")
    if not sanity.get("ok", True):
        print("WARNING: every measurement failed its checks (" + "; ".join(sanity.get("problems", []))
              + "); the curve is used for an hour at most. Calibrate again on a quieter machine.")
        return 1
    return 0
