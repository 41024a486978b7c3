"""The verify-cost curve, read-only: seconds of one target forward over N tree tokens, as `dart-hf calibrate`
measured it on this device (`dart_hf.tools.calibrate` measures, checks and writes it; decoding only reads it).

A curve lives in `$DART_HF_CACHE/cost/` (default `~/.cache/dart_hf/cost/`), one JSON file per key: the model's name
and shape, the device (and CPU thread count), dtype, attention implementation, quantization and the torch /
transformers versions. Only a measurement that passed its checks is ever written, so a file that exists and parses
is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers

COST_VERSION = 8  # 8: stock kernels (no CPU linears / grouped attention in the measured forward)


@dataclass
class VerifyCost:
    """Seconds of one verify forward by number of tree tokens N (root included), piecewise linear between the
    measured sizes and extrapolated along the last segment. `record`: how and when it was measured."""

    sizes: list[int]
    seconds: list[float]
    key: dict | None = None
    path: str | None = None
    record: dict = field(default_factory=dict)

    def __call__(self, n) -> np.ndarray | float:
        xs, ys = np.asarray(self.sizes, dtype=float), np.asarray(self.seconds, dtype=float)
        n_arr = np.asarray(n, dtype=float)
        out = np.interp(n_arr, xs, ys)
        if len(xs) >= 2:
            slope_hi = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(n_arr > xs[-1], ys[-1] + slope_hi * (n_arr - xs[-1]), out)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        return {**self.record, "sizes": list(self.sizes), "seconds": list(self.seconds), "key": self.key}


def nearest_size(sizes, b: int) -> int:
    """The tree size in `sizes` nearest to b in ratio of tree tokens (b + 1; ties: the smaller)."""
    return min(sizes, key=lambda a: (abs(np.log((b + 1) / (a + 1))), a))


def cost_dir() -> Path:
    """`$DART_HF_CACHE/cost`, else `~/.cache/dart_hf/cost` (same root as dart_hf.tools.assets.cache_dir)."""
    return Path(os.environ.get("DART_HF_CACHE", "~/.cache/dart_hf")).expanduser() / "cost"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{platform.machine()}-{platform.processor() or 'cpu'}-{torch.get_num_threads()}threads"
    return device.type


def cost_key(target) -> dict:
    """What the verify cost depends on (how it was measured, sizes and KV length, is not part of the key)."""
    cfg = target.config.get_text_config()
    names = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "vocab_size")
    quant = getattr(target.config, "quantization_config", None)
    return {
        "name": str(getattr(target.config, "name_or_path", "") or cfg.model_type),
        **{k: getattr(cfg, k, None) for k in names},
        "device": target.device.type,
        "device_name": _device_name(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "attn_implementation": target.config._attn_implementation or "eager",
        "quantization": None if quant is None else str(getattr(quant, "quant_method", quant)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "version": COST_VERSION,
    }


def cost_file(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(key["name"]).name or key["model_type"] or "model")[:60]
    return cost_dir() / f"{slug}-{key['device']}-{key['dtype']}-{digest}.json"


def load_curve(target) -> VerifyCost | None:
    """This target's calibrated curve on this device if its file exists, parses and belongs to this key; else None
    (then `dart-hf calibrate` measures it)."""
    key = cost_key(target)
    path = cost_file(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    sizes, seconds = data.get("sizes"), data.get("seconds")
    if not isinstance(sizes, list) or not isinstance(seconds, list) or not sizes or len(sizes) != len(seconds):
        return None
    record = {k: v for k, v in data.items() if k not in ("sizes", "seconds", "key")}
    return VerifyCost([int(n) for n in sizes], [float(s) for s in seconds], key=key, path=str(path), record=record)


__all__ = ["VerifyCost", "nearest_size", "cost_dir", "cost_file", "cost_key", "load_curve"]
