"""What the ops share (kernels/common): the page-table helpers (property tests) and dispatch."""

from __future__ import annotations

import mm_oval.kernels as K
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mm_oval.kernels.common import dispatch
from mm_oval.kernels.common.pagetable import (
    pad_selection,
    paginate,
    selected_token_count,
    selected_token_mask,
)

from mm_oval.errors import ConfigError

# ------------------------------------------------------------------------------- page-table helpers

lengths_strategy = st.lists(
    st.lists(st.integers(0, 70), min_size=1, max_size=3), min_size=1, max_size=3
).filter(lambda rows: len({len(r) for r in rows}) == 1)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy, page_size=st.integers(1, 33))
def test_paginate_tiles_each_head_exactly(lengths, page_size):
    L = torch.tensor(lengths)
    start, length = paginate(L, page_size)
    assert start.dtype == length.dtype == torch.int32
    assert torch.all((length >= 0) & (length <= page_size))
    for b in range(L.shape[0]):
        for h in range(L.shape[1]):
            covered = []
            for s, n in zip(start[b, h].tolist(), length[b, h].tolist()):
                covered += list(range(s, s + n))
            assert covered == list(range(int(L[b, h])))  # in order, disjoint, nothing missing
            used = (length[b, h] > 0).tolist()
            assert used == sorted(used, reverse=True)  # used pages first, then empty slots
            full = length[b, h][length[b, h] > 0][:-1]
            assert torch.all(full == page_size)  # only the last (open) page may be short


@settings(max_examples=40, deadline=None)
@given(
    lengths=lengths_strategy,
    page_size=st.integers(1, 17),
    seed=st.integers(0, 2**16),
    width=st.integers(0, 6),
)
def test_selected_token_mask_and_count_follow_the_selection(lengths, page_size, seed, width):
    L = torch.tensor(lengths)
    start, length = paginate(L, page_size)
    P = start.shape[-1]
    g = torch.Generator().manual_seed(seed)
    B, H = L.shape
    sel = [
        [torch.randperm(max(P, 1), generator=g)[: min(width, P)].tolist() for _ in range(H)] for _ in range(B)
    ]
    idx = pad_selection(sel, width=width)
    assert idx.shape == (B, H, width) and idx.dtype == torch.int32
    N = int(L.max()) + 2
    mask = selected_token_mask(start, length, idx, N)
    count = selected_token_count(length, idx)
    for b in range(B):
        for h in range(H):
            want = torch.zeros(N, dtype=torch.bool)
            for p in sel[b][h]:
                want[int(start[b, h, p]) : int(start[b, h, p] + length[b, h, p])] = True
            assert torch.equal(mask[b, h], want)
            assert int(count[b, h]) == int(want.sum())


def test_pad_selection_and_paginate_refuse_what_does_not_fit():
    with pytest.raises(ConfigError, match="width"):
        pad_selection([[[0, 1, 2]]], width=2)
    with pytest.raises(ConfigError, match="num_pages"):
        paginate(torch.tensor([[40]]), 16, num_pages=2)
    with pytest.raises(ConfigError, match="page_size"):
        paginate(torch.tensor([[4]]), 0)


# ------------------------------------------------------------------------------------------ dispatch


def test_dispatch_uses_references_on_cpu_and_honours_the_override(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    assert K.backend(x) == "torch"
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert K.backend(x) == "torch"
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.INTERPRETED  # tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton
    assert K.backend(x) == "triton"
    monkeypatch.setattr(dispatch, "INTERPRETED", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        K.backend(x)
    monkeypatch.setenv(dispatch.ENV, "cuda")
    with pytest.raises(ConfigError, match="not understood"):
        K.backend(x)


def test_forced_triton_and_torch_give_the_same_answers(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    k = torch.randn(2, 2, 40, 64, generator=g)
    v = torch.randn(2, 2, 40, 64, generator=g)
    start, length = paginate(torch.tensor([[40, 17], [3, 33]]), 8)
    idx = pad_selection([[[0, 4], [2]], [[0], [1, 4, 3]]], width=3)
    results = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv(dispatch.ENV, name)
        results[name] = K.sparse_paged_decode(q, k, v, start, length, idx)
    torch.testing.assert_close(results["torch"], results["triton"])


def test_bad_shapes_are_config_errors():
    q = torch.zeros(1, 6, 64)
    k = torch.zeros(1, 4, 10, 64)
    start = torch.zeros(1, 4, 2, dtype=torch.int32)
    with pytest.raises(ConfigError, match="not a multiple"):
        K.sparse_paged_decode(q, k, k, start, start, start)
    with pytest.raises(ConfigError, match="one decode token"):
        K.sparse_paged_decode(torch.zeros(1, 4, 1, 64), k, k, start, start, start)
