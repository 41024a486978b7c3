"""Which transformers dart_hf runs on: the floor (`import dart_hf` refuses an older release; test_install.py checks
that pyproject pins the same), and model code written before transformers 5.24 renamed the cache argument
(remote-code targets)."""

from __future__ import annotations

import subprocess
import sys

import torch

from dart_hf.core.target import cache_kwargs


def test_the_kv_cache_goes_by_the_name_this_transformers_takes():
    """transformers 5.24 renamed the forward argument `past_key_values` to `cache`; releases before it swallow an
    unknown `cache=` in **kwargs and run WITHOUT the cache (DART then verified trees against no past at all)."""

    class Before524(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    class From524(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return cache

    marker = object()
    for model in (Before524(), From524()):
        assert model(**cache_kwargs(model, marker)) is marker
    assert list(cache_kwargs(Before524(), marker)) == ["past_key_values"]


def test_an_older_transformers_is_refused_at_import():
    """transformers 5.3 fails on DartConfig, 5.4 runs and captures no target states: the import says what to do."""
    code = "import transformers; transformers.__version__ = '5.24.0'; import dart_hf"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0 and "dart_hf needs transformers >= 5.25, found 5.24.0" in run.stderr, run.stderr
    ok = subprocess.run([sys.executable, "-c", "import transformers; transformers.__version__ = '5.25.0.dev0'; "
                         "import dart_hf"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
