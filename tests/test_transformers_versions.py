"""What differs between the transformers 5.x releases dart_hf supports (pyproject: >=5.0,<6)."""

from __future__ import annotations

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
