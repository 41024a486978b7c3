"""Export a trained head folder as a Hub-ready folder: bf16 weights (half the size), n-gram, custom_generate/.

    python examples/export_head.py runs/smollm2-head model_cards/smollm2-135m-instruct-dart

The card (README.md) is written by hand with the measured numbers; this script keeps it if present.
custom_generate/ is regenerated (it loads the head from whatever folder or repo it is called with).
"""

import sys

import torch
from transformers import AutoModel

import dart_hf  # noqa: F401  (registers the "dart" model type)
from dart_hf.tools.hub import write_custom_generate


def main(src: str, dst: str) -> None:
    head = AutoModel.from_pretrained(src, dtype=torch.float32)
    head.to(torch.bfloat16).save_pretrained(dst)  # saves ngram.safetensors too
    write_custom_generate(dst)
    print(f"exported {src} -> {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
