"""DART as a transformers `custom_generate` entry point, for machines without dart_hf installed.

    target.generate(input_ids, custom_generate="<head folder or repo>", trust_remote_code=True, max_new_tokens=64)

`dart_hf.tools.hub.write_custom_generate` copies this module to `<head folder>/custom_generate/generate.py`, next to
verbatim copies of the dart_hf modules it imports (transformers copies relative imports along with generate.py),
and fills in `HEAD_LOCATION`: the folder, or the Hub repo the folder is pushed to. The copy never imports
dart_hf. transformers calls `generate(model=target, **every generate() argument)`; this function loads the head
once per location, casts and places it for the target, and hands over to `target.generate` with the DART loop
as the decoding method, so transformers still prepares the generation config, processors and stopping criteria.
"""

from __future__ import annotations

import os

from ..core.loop import dart_decode
from ..core.modeling import DartHead
from ..core.target import prepare_head

HEAD_LOCATION: str | None = None
_HEADS: dict[str, DartHead] = {}


def load_head(location: str) -> DartHead:
    """The head at `location` (folder or repo id), loaded once per process."""
    if location not in _HEADS:
        _HEADS[location] = DartHead.from_pretrained(location).eval()
    return _HEADS[location]


def generate(model, *args, dart_head: str | os.PathLike | None = None, streamer=None, **kwargs):
    """`model.generate(...)` with DART tree decoding. `dart_head` overrides where the head is loaded from."""
    location = os.fspath(dart_head) if dart_head is not None else HEAD_LOCATION
    if location is None:
        raise ValueError("no DART head location: pass dart_head=<head folder or repo id>")
    head = prepare_head(load_head(location), model)
    return model.generate(*args, custom_generate=dart_decode, dart_head=head, dart_streamer=streamer, **kwargs)
