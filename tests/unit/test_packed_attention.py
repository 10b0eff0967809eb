"""The packed pass's decoding attention: the grouped form it takes outside float32 is the
same arithmetic as grouped-query attention (query head h reads key-value head h // group)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from modelpool.backends.hf.packed import _decoding_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_decoding_attention_equals_grouped_query_attention(
    dtype: torch.dtype, masked: bool
) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, columns, dim = 5, 9, 3, 37, 16
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    # Key-value heads far apart, so that a query head reading the wrong one shows.
    keys = torch.randn(rows, kv_heads, columns, dim, generator=generator)
    keys = keys * torch.tensor([0.1, 1.0, 3.0])[None, :, None, None]
    values = torch.randn(rows, kv_heads, columns, dim, generator=generator)
    values = values + torch.tensor([-10.0, 0.0, 10.0])[None, :, None, None]
    mask = None
    if masked:
        lengths = torch.tensor([37, 1, 20, 30, 5])
        mask = (torch.arange(columns)[None, :] < lengths[:, None])[:, None, None, :]
    expected = scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    answered = _decoding_attention(
        query.to(dtype), keys.to(dtype), values.to(dtype), mask, 0.3
    )
    assert answered.shape == expected.shape
    assert answered.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    assert torch.allclose(answered.float(), expected, atol=tolerance, rtol=0.02)
