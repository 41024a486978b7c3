"""DART as a transformers `custom_generate` entry point, for machines without dart_hf installed.

    target.generate(input_ids, custom_generate="<head folder or Hub repo>", trust_remote_code=True, max_new_tokens=64)

`dart_hf.tools.hub.write_custom_generate` writes this module as `<head folder>/custom_generate/generate.py` (its
`from ..core.x import` lines become `from .x import`) beside whole, verbatim copies of the `dart_hf/core` modules.
transformers copies generate.py and every file named by a `from .x import` line (recursively) into its module cache
(`HF_MODULES_CACHE`) and imports it from there, so the copy never imports dart_hf.

Where the head is: because transformers runs the cached copy, `__file__` does not lead back to the weights. The head
is where the code came from: the `custom_generate=` argument of the transformers `generate` call that is running this
function (a local folder, or a Hub repo id whose snapshot holds the weights beside `custom_generate/`), read from
that call's frame. `dart_head=<folder or repo id>` overrides it. transformers calls
`generate(model=target, **every generate() argument)`; the prompt is checked (`checks.check_prompt`: transformers
would fail on an empty batch before the loop's own checks), the head is loaded once per location and the call goes
back to `target.generate` with the DART loop as the decoding method (which checks and places the head, as for any
call), so transformers still prepares the generation config, processors and stopping criteria.
"""

from __future__ import annotations

import os
import sys

from ..core.checks import check_prompt
from ..core.loop import dart_decode
from ..core.modeling import DartHead

# generate() arguments that say where the code came from; transformers passes them on to this function too
_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")
_HEADS: dict[tuple, DartHead] = {}


def load_head(location: str, **hub_kwargs) -> DartHead:
    """The head at `location` (folder or repo id), loaded once per process and location."""
    key = (location, tuple(sorted(hub_kwargs.items())))
    if key not in _HEADS:
        _HEADS[key] = DartHead.from_pretrained(location, **hub_kwargs).eval()
    return _HEADS[key]


def requested_location(model) -> str | None:
    """The `custom_generate=` folder or repo id of the transformers `generate(self=model)` call on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (
            code.co_name == "generate"
            and code.co_filename.replace(os.sep, "/").endswith("transformers/generation/utils.py")
            and frame.f_locals.get("self") is model
        ):
            location = frame.f_locals.get("custom_generate")
            return os.fspath(location) if isinstance(location, (str, os.PathLike)) else None
        frame = frame.f_back
    return None


def generate(model, *args, dart_head: str | os.PathLike | None = None, streamer=None, **kwargs):
    """`model.generate(...)` with DART tree decoding, drafting with the head this code was loaded from."""
    hub_kwargs = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    location = os.fspath(dart_head) if dart_head is not None else requested_location(model)
    if location is None:
        raise ValueError(
            "no DART head location: call target.generate(..., custom_generate=<head folder or repo id>, "
            "trust_remote_code=True), or pass dart_head=<head folder or repo id>"
        )
    check_prompt(model, args, kwargs, "tree")  # before transformers prepares the prompt (and the head loads)
    head = load_head(location, **hub_kwargs)
    return model.generate(*args, custom_generate=dart_decode, dart_head=head, dart_streamer=streamer, **kwargs)
