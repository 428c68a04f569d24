"""Compaction: the Triton kernel (interpreter on CPU) against naive.py, and the argument checks."""

from __future__ import annotations

import mm_oval.kernels as K
import pytest
import torch
from mm_oval.kernels.compact.kernel import compact_kv_triton
from mm_oval.kernels.compact.naive import compact_kv_naive

from mm_oval.errors import ConfigError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, H, N, D, capacity", [(1, 2, 50, 64, None), (3, 2, 40, 128, 48), (2, 1, 9, 16, 12)]
)
def test_compact_kernel_matches_reference(B, H, N, D, capacity, dtype):
    g = torch.Generator().manual_seed(N)
    k = torch.randn(B, H, N, D, generator=g).to(dtype)
    v = torch.randn(B, H, N, D, generator=g).to(dtype)
    M = min(N, 30)
    index = torch.stack(
        [torch.stack([torch.randperm(N, generator=g)[:M].sort().values for _ in range(H)]) for _ in range(B)]
    )
    index[0, 0, M - 3 :] = -1  # a head that keeps fewer tokens
    want = compact_kv_naive(k, v, index, capacity)
    got = compact_kv_triton(k, v, index.to(torch.int32), capacity)
    for a, b in zip(got, want):
        assert a.dtype == dtype and torch.equal(a, b)
    # the reference's meaning: row m of head (b, h) is token index[b, h, m]; the rest is zero
    b, h = B - 1, H - 1
    torch.testing.assert_close(want[0][b, h, :M], k[b, h, index[b, h]])
    assert torch.all(want[0][0, 0, M - 3 :] == 0)


def test_compact_rejects_a_capacity_below_the_kept_tokens():
    k = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ConfigError, match="capacity"):
        K.compact_kv(k, k, torch.zeros(1, 1, 5, dtype=torch.long), capacity=4)
