"""Page scoring (LOCKS / OVAL low-rank bases, Quest bound) and top-k page selection: the Triton kernels
(interpreter on CPU) against the references, and the references against what they estimate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mm_oval.kernels import select_pages
from mm_oval.kernels.page_score import page_score_lowrank_triton, page_score_quest_triton
from mm_oval.kernels.reference import (
    page_raw_lowrank_ref,
    page_raw_quest_ref,
    page_score_lowrank_ref,
    page_score_quest_ref,
    select_pages_ref,
)
from mm_oval.kernels.topk import select_pages_triton

from mm_oval.errors import ConfigError


def summaries(B, Hkv, G, D, P, T, R, seed, dtype=torch.float32, lengths=None):
    """Exact LOCKS summaries of random pages (centroid, top-R PCA basis, coefficients) and Quest's
    per-channel min/max, with page lengths 1..T, one empty slot at the end."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, D, generator=g)
    keys = torch.randn(B, Hkv, P, T, D, generator=g) + 0.5 * torch.randn(B, Hkv, P, 1, D, generator=g)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B, Hkv, P), generator=g)
        lengths[..., 0] = 1
        lengths[..., 1] = T
        lengths[..., -1] = 0
    valid = torch.arange(T)[None, None, None, :] < lengths[..., None]
    keys = keys * valid[..., None]
    mu = keys.sum(-2) / lengths.clamp_min(1)[..., None]
    x = (keys - mu[..., None, :]) * valid[..., None]
    _, _, vh = torch.linalg.svd(x, full_matrices=True)  # rows of vh: principal directions
    basis = vh[..., :R, :].transpose(-1, -2).contiguous()  # (B, Hkv, P, D, R)
    coef = x @ basis
    kmin = keys.masked_fill(~valid[..., None], float("inf")).amin(-2).masked_fill(lengths[..., None] == 0, 0)
    kmax = keys.masked_fill(~valid[..., None], float("-inf")).amax(-2).masked_fill(lengths[..., None] == 0, 0)
    cast = [t.to(dtype) for t in (q, mu, basis, coef, kmin, kmax)]
    return (*cast, lengths.to(torch.int32), keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, Hkv, G, D, P, T, R",
    [(1, 2, 1, 64, 6, 16, 8), (3, 1, 4, 128, 5, 32, 8), (1, 2, 8, 64, 9, 1, 4), (1, 2, 4, 64, 20, 16, 8)],
)
def test_page_scoring_kernels_match_references(B, Hkv, G, D, P, T, R, dtype):
    q, mu, basis, coef, kmin, kmax, lengths, _ = summaries(B, Hkv, G, D, P, T, R, seed=P + G, dtype=dtype)
    got = page_score_lowrank_triton(q, mu, basis, coef, lengths)
    want = page_score_lowrank_ref(q, mu, basis, coef, lengths)
    assert torch.equal(torch.isinf(got), lengths == 0) and torch.equal(torch.isinf(want), lengths == 0)
    f = lengths > 0
    torch.testing.assert_close(got[f], want[f], rtol=1e-5, atol=1e-5)
    got = page_score_quest_triton(q, kmin, kmax, lengths, scale=0.3)
    want = page_score_quest_ref(q, kmin, kmax, lengths, scale=0.3)
    assert torch.equal(torch.isinf(got), lengths == 0)
    torch.testing.assert_close(got[f], want[f], rtol=1e-5, atol=1e-5)


def test_full_rank_basis_gives_the_exact_page_attention_mass():
    """With R = D the basis reconstructs every key, so the score is log sum_i exp(scale q.k_i)."""
    B, Hkv, G, D, P, T = 1, 2, 2, 16, 4, 8
    q, mu, basis, coef, _, _, lengths, keys = summaries(B, Hkv, G, D, P, T, D, seed=1)
    raw = page_raw_lowrank_ref(q, mu, basis, coef, lengths, scale=0.25)  # (B, Hkv, G, P)
    for h in range(Hkv):
        for g in range(G):
            for p in range(P):
                n = int(lengths[0, h, p])
                exact = (
                    torch.logsumexp(keys[0, h, p, :n] @ q[0, h * G + g] * 0.25, 0)
                    if n
                    else torch.tensor(float("-inf"))
                )
                torch.testing.assert_close(raw[0, h, g, p], exact, rtol=1e-4, atol=1e-4)


def test_quest_bound_is_an_upper_bound_of_every_key_score():
    B, Hkv, G, D, P, T = 2, 2, 4, 32, 5, 16
    q, _, _, _, kmin, kmax, lengths, keys = summaries(B, Hkv, G, D, P, T, 4, seed=2)
    raw = page_raw_quest_ref(q, kmin, kmax, lengths, scale=1.0)
    scores = torch.einsum("bhgd,bhptd->bhgpt", q.view(B, Hkv, G, D), keys)
    valid = torch.arange(T) < lengths[..., None]
    best = scores.masked_fill(~valid[:, :, None], float("-inf")).amax(-1)
    f = (lengths > 0)[:, :, None].expand_as(best)
    assert torch.all(raw[f] >= best[f] - 1e-4)


def test_gqa_combination_is_the_group_average_of_page_softmaxes():
    B, Hkv, G, D, P, T = 2, 2, 4, 32, 7, 8
    q, mu, basis, coef, _, _, lengths, _ = summaries(B, Hkv, G, D, P, T, 4, seed=3)
    raw = page_raw_lowrank_ref(q, mu, basis, coef, lengths)
    combined = page_score_lowrank_ref(q, mu, basis, coef, lengths)
    torch.testing.assert_close(combined.exp(), torch.softmax(raw, -1).mean(2))
    torch.testing.assert_close(combined.exp().sum(-1), torch.ones(B, Hkv))
    # with one query head per KV head the order of pages is the order of the raw scores
    q1, mu1, b1, c1, _, _, len1, _ = summaries(1, 3, 1, 32, 9, 8, 4, seed=4)
    one = page_score_lowrank_ref(q1, mu1, b1, c1, len1)
    raw1 = page_raw_lowrank_ref(q1, mu1, b1, c1, len1)[:, :, 0]
    for h in range(3):
        f = len1[0, h] > 0
        assert torch.equal(one[0, h][f].argsort(), raw1[0, h][f].argsort())


def test_a_head_without_pages_scores_minus_inf_everywhere():
    lengths = torch.tensor([[[3, 2, 0], [0, 0, 0]]])
    q, mu, basis, coef, kmin, kmax, lengths, _ = summaries(1, 2, 4, 16, 3, 4, 2, seed=5, lengths=lengths)
    for got in (
        page_score_lowrank_triton(q, mu, basis, coef, lengths),
        page_score_quest_triton(q, kmin, kmax, lengths),
    ):
        assert torch.all(got[0, 1] == float("-inf")) and torch.isfinite(got[0, 0, :2]).all()


# ------------------------------------------------------------------------------------- top-k selection


def test_select_kernel_matches_reference_with_ties_nan_inf_and_duplicate_keeps():
    g = torch.Generator().manual_seed(0)
    for B, H, P, k, K0 in [
        (2, 3, 10, 4, 2),
        (1, 2, 7, 7, 3),
        (3, 1, 40, 5, 0),
        (1, 1, 5, 3, 3),
        (1, 2, 300, 16, 2),
    ]:
        s = torch.randn(B, H, P, generator=g)
        s[..., 3] = s[..., 4]  # a tie
        s[0, 0, 1] = float("-inf")
        s[0, 0, 2] = float("nan")
        s[0, -1] = float("-inf")  # a head with nothing to choose
        keep = torch.randint(-1, P + 1, (B, H, K0), generator=g, dtype=torch.int32) if K0 else None
        if keep is not None:
            keep[0, 0, -1] = keep[0, 0, 0]  # a duplicate
        want = select_pages_ref(s, k, keep)
        assert torch.equal(select_pages_triton(s, k, keep), want)
        assert torch.equal(select_pages(s, k, keep), want)


def test_select_puts_kept_pages_first_then_best_pages():
    s = torch.tensor([[[0.5, 3.0, -1.0, 2.0, float("-inf"), 1.0]]])
    keep = torch.tensor([[[5, 0, 5, -1]]])
    for fn in (select_pages_ref, select_pages_triton):
        assert fn(s, 5, keep).tolist() == [[[5, 0, 1, 3, 2]]]
        assert fn(s, 8, keep).tolist() == [[[5, 0, 1, 3, 2, -1, -1, -1]]]  # never the -inf page
        assert fn(s, 2, None).tolist() == [[[1, 3]]]


def test_select_rejects_more_kept_pages_than_the_budget():
    with pytest.raises(ConfigError, match="budget"):
        select_pages(torch.zeros(1, 1, 4), 2, torch.zeros(1, 1, 3, dtype=torch.int32))


@settings(max_examples=30, deadline=None)
@given(
    P=st.integers(1, 24),
    k=st.integers(1, 12),
    K0=st.integers(0, 4),
    seed=st.integers(0, 2**16),
    ninf=st.integers(0, 6),
)
def test_select_reference_properties(P, k, K0, seed, ninf):
    K0 = min(K0, k)
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, 1, P, generator=g).round(decimals=1)  # rounding makes ties common
    s[0, 0, torch.randperm(P, generator=g)[:ninf]] = float("-inf")
    keep = torch.randint(-1, P + 2, (1, 1, K0), generator=g)
    out = select_pages_ref(s, k, keep)[0, 0].tolist()
    chosen = [p for p in out if p >= 0]
    assert out == chosen + [-1] * (k - len(chosen))  # padding only at the end
    assert len(set(chosen)) == len(chosen)  # distinct
    kept = list(dict.fromkeys(p for p in keep[0, 0].tolist() if 0 <= p < P))
    assert chosen[: len(kept)] == kept  # kept pages first, in order
    rest = chosen[len(kept) :]
    others = [p for p in range(P) if p not in kept and s[0, 0, p] > float("-inf")]
    assert len(rest) == min(k - len(kept), len(others))  # fills the budget when it can
    worst_taken = min((float(s[0, 0, p]) for p in rest), default=float("inf"))
    assert all(float(s[0, 0, p]) <= worst_taken for p in others if p not in rest)  # the best ones
    assert [float(s[0, 0, p]) for p in rest] == sorted((float(s[0, 0, p]) for p in rest), reverse=True)
