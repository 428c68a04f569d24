"""Sparse paged decode attention: the Triton kernel (Triton's interpreter on CPU) against the PyTorch
reference, and the reference against plain attention over the tokens it should read."""

from __future__ import annotations

import pytest
import torch
from mm_oval.kernels import merge_attention, paginate, selected_token_mask, sparse_paged_decode
from mm_oval.kernels.common.pagetable import pad_selection
from mm_oval.kernels.sparse_decode.kernel import sparse_paged_decode_triton
from mm_oval.kernels.sparse_decode.naive import sparse_paged_decode_naive

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def ragged_case(B: int, Hkv: int, G: int, D: int, seed: int, dtype: torch.dtype, long_page: int = 70):
    """Per-head ragged storage cut into pages of mixed lengths, including a 1-token page and a page
    longer than any kernel tile. Head (0, 0) selects only its open (last) page; other heads select a
    random subset plus the open page, in shuffled order with -1 holes."""
    g = torch.Generator().manual_seed(seed)
    page_lengths = [1, long_page, 5, 16, 3, 33]
    N = sum(page_lengths) + 8
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    P = len(page_lengths) + 1
    page_start = torch.zeros(B, Hkv, P, dtype=torch.int32)
    page_len = torch.zeros(B, Hkv, P, dtype=torch.int32)
    selections = []
    for b in range(B):
        row = []
        for h in range(Hkv):
            perm = torch.randperm(len(page_lengths), generator=g).tolist()
            lengths = [page_lengths[i] for i in perm]
            if b == 0 and h == Hkv - 1:
                lengths = lengths[:3]  # a head with fewer pages than others
            open_len = int(torch.randint(1, 9, (1,), generator=g))
            start = 0
            for j, n in enumerate([*lengths, open_len]):
                page_start[b, h, j], page_len[b, h, j] = start, n
                start += n
            open_page = len(lengths)
            if b == 0 and h == 0:
                sel = [open_page]
            else:
                chosen = [j for j in range(len(lengths)) if torch.rand(1, generator=g).item() < 0.6]
                sel = [*chosen, open_page]
                sel = [sel[i] for i in torch.randperm(len(sel), generator=g).tolist()]
                sel.insert(1, -1)
            row.append(sel)
        selections.append(row)
    page_idx = pad_selection(selections, width=P + 2)
    return q, k, v, page_start, page_len, page_idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, Hkv, G, D",
    [(1, 2, 1, 64), (3, 2, 4, 128), (1, 1, 8, 128), (3, 1, 8, 64), (1, 3, 4, 64)],
)
def test_kernel_matches_reference(B, Hkv, G, D, dtype):
    q, k, v, ps, pl, idx = ragged_case(B, Hkv, G, D, seed=B * 100 + G * 10 + D, dtype=dtype)
    ref_out, ref_lse = sparse_paged_decode_naive(q, k, v, ps, pl, idx)
    for splits in (1, 3):
        out, lse = sparse_paged_decode_triton(q, k, v, ps, pl, idx, num_splits=splits)
        assert out.dtype == dtype and out.shape == (B, Hkv * G, D)
        assert lse.dtype == torch.float32 and lse.shape == (B, Hkv * G)
        assert rel_err(out, ref_out) < TOL[dtype], f"splits={splits}"
        assert rel_err(lse, ref_lse) < 1e-5, f"splits={splits}"


def test_reference_is_attention_over_the_selected_tokens():
    q, k, v, ps, pl, idx = ragged_case(2, 2, 4, 64, seed=7, dtype=torch.float32)
    out, lse = sparse_paged_decode_naive(q, k, v, ps, pl, idx, scale=0.2)
    mask = selected_token_mask(ps, pl, idx, k.shape[2])
    for b in range(2):
        for hq in range(8):
            h = hq // 4  # query heads 4h .. 4h+3 share KV head h
            rows = mask[b, h].nonzero().squeeze(-1)
            s = (k[b, h, rows] @ q[b, hq]) * 0.2
            torch.testing.assert_close(lse[b, hq], torch.logsumexp(s, 0))
            torch.testing.assert_close(out[b, hq], torch.softmax(s, 0) @ v[b, h, rows])


def test_head_reading_nothing_gives_zero_and_minus_inf():
    q, k, v, ps, pl, idx = ragged_case(1, 2, 4, 64, seed=3, dtype=torch.float32)
    idx[0, 1] = -1
    for fn in (sparse_paged_decode_naive, sparse_paged_decode_triton):
        out, lse = fn(q, k, v, ps, pl, idx)
        assert torch.all(out[0, 4:] == 0) and torch.all(lse[0, 4:] == float("-inf"))
        assert torch.isfinite(lse[0, :4]).all()


def test_merge_with_the_open_page_equals_attention_over_both():
    """The pattern the cache uses: closed pages through the kernel, the open page separately, merged."""
    q, k, v, ps, pl, idx = ragged_case(3, 2, 4, 64, seed=11, dtype=torch.float32)
    whole = sparse_paged_decode(q, k, v, ps, pl, idx)
    is_open = idx == (pl > 0).sum(-1, keepdim=True) - 1
    closed = torch.where(is_open, -1, idx)
    only_open = torch.where(is_open, idx, -1)
    a = sparse_paged_decode(q, k, v, ps, pl, closed)
    b = sparse_paged_decode(q, k, v, ps, pl, only_open)
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, whole[0])
    torch.testing.assert_close(lse, whole[1])
    # merging with an empty part is the identity
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    out2, lse2 = merge_attention(out, lse, *empty)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse)


def test_strided_views_and_int64_tables():
    """The cache may hand over views of larger buffers and int64 page tables."""
    q, k, v, ps, pl, idx = ragged_case(1, 2, 4, 64, seed=5, dtype=torch.float32)
    big_k = torch.randn(1, 2, k.shape[2] + 10, 64)
    big_k[:, :, : k.shape[2]] = k
    kv_view = big_k[:, :, : k.shape[2]]
    out, lse = sparse_paged_decode_triton(q, kv_view, v, ps.long(), pl.long(), idx.long(), num_splits=2)
    ref_out, ref_lse = sparse_paged_decode_naive(q, k, v, ps, pl, idx)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("page_size, max_page_len", [(1, None), (16, None), (16, 32), (8, 8)])
def test_many_pages_per_tile(page_size, max_page_len):
    """Short pages share one kernel tile (64 / page_size of them); the split boundaries fall inside."""
    g = torch.Generator().manual_seed(page_size)
    B, Hkv, G, D, N = 3, 2, 4, 128, 90
    q = torch.randn(B, Hkv * G, D, generator=g).half()
    k = torch.randn(B, Hkv, N, D, generator=g).half()
    v = torch.randn(B, Hkv, N, D, generator=g).half()
    lengths = torch.randint(N // 2, N + 1, (B, Hkv), generator=g)
    start, length = paginate(lengths, page_size)
    P = start.shape[-1]
    sel = [
        [
            [p for p in torch.randperm(int((length[b, h] > 0).sum()), generator=g).tolist() if p % 3]
            for h in range(Hkv)
        ]
        for b in range(B)
    ]
    idx = pad_selection(sel, width=P)
    want = sparse_paged_decode_naive(q, k, v, start, length, idx)
    for splits in (1, 3):
        got = sparse_paged_decode_triton(
            q, k, v, start, length, idx, num_splits=splits, max_page_len=max_page_len
        )
        assert rel_err(got[0], want[0]) < TOL[torch.float16] and rel_err(got[1], want[1]) < 1e-5


def test_fp32_query_over_fp16_cache_keeps_the_query_dtype():
    q, k, v, ps, pl, idx = ragged_case(1, 2, 4, 64, seed=9, dtype=torch.float16)
    q32 = q.float()
    out, lse = sparse_paged_decode_triton(q32, k, v, ps, pl, idx)
    ref_out, ref_lse = sparse_paged_decode_naive(q32, k, v, ps, pl, idx)
    assert out.dtype == torch.float32
    assert rel_err(out, ref_out) < TOL[torch.float16] and rel_err(lse, ref_lse) < 1e-3
