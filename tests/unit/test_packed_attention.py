"""The packed pass's decoding attention: the grouped form it takes outside float32 is the
same arithmetic as grouped-query attention (query head h reads key-value head h // group)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from modelpool.worker.backends.hf.packed import _decoding_attention


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
    answered = _decoding_attention(query.to(dtype), keys.to(dtype), values.to(dtype), mask, 0.3)
    assert answered.shape == expected.shape
    assert answered.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    assert torch.allclose(answered.float(), expected, atol=tolerance, rtol=0.02)


def test_decoding_attention_groups_a_strided_query_as_the_packed_pass_slices_it() -> None:
    # transformers hands attention [1, heads, tokens, dim] as a transpose of
    # [1, tokens, heads, dim]; the packed pass takes one token's column of it (a row alone)
    # or a gather of them (the gathered rows, not contiguous).
    generator = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, columns, dim = 4, 8, 2, 23, 16
    query = torch.randn(1, tokens, heads, dim, generator=generator).transpose(1, 2)
    keys = torch.randn(1, kv_heads, columns, dim, generator=generator)
    values = torch.randn(1, kv_heads, columns, dim, generator=generator)
    values = values + torch.tensor([-10.0, 10.0])[None, :, None, None]
    one = query[:, :, 2:3]
    gathered = query[0][:, torch.tensor([3, 1])].transpose(0, 1).unsqueeze(2)
    assert not gathered.is_contiguous()
    for strided in (one, gathered):
        rows = strided.shape[0]
        expanded = (keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1))
        expected = scaled_dot_product_attention(strided, *expanded, enable_gqa=True)
        answered = _decoding_attention(
            strided.bfloat16(), expanded[0].bfloat16(), expanded[1].bfloat16(), None, None
        )
        assert torch.allclose(answered.float(), expected, atol=0.1, rtol=0.02)
