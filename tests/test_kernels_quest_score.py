"""Quest page scoring: the Triton kernel (interpreter on CPU) against naive.py, and the reference's
bound against every key of the page."""

from __future__ import annotations

import pytest
import torch
from mm_oval.kernels import page_score_quest
from mm_oval.kernels.quest_score.kernel import page_score_quest_triton
from mm_oval.kernels.quest_score.naive import page_raw_quest_naive, page_score_quest_naive

from mm_oval.errors import ConfigError


def page_summaries(B, Hkv, G, D, P, T, seed, dtype=torch.float32, lengths=None):
    """Random pages of lengths 1..T (one empty slot at the end) -> q, kmin, kmax, lengths, keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, D, generator=g)
    keys = torch.randn(B, Hkv, P, T, D, generator=g) + 0.5 * torch.randn(B, Hkv, P, 1, D, generator=g)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B, Hkv, P), generator=g)
        lengths[..., 0] = 1
        lengths[..., -1] = 0
    valid = (torch.arange(T) < lengths[..., None])[..., None]
    empty = lengths[..., None] == 0
    kmin = keys.masked_fill(~valid, float("inf")).amin(-2).masked_fill(empty, 0)
    kmax = keys.masked_fill(~valid, float("-inf")).amax(-2).masked_fill(empty, 0)
    return q.to(dtype), kmin.to(dtype), kmax.to(dtype), lengths.to(torch.int32), keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, Hkv, G, D, P, T",
    [(1, 2, 1, 64, 6, 16), (3, 1, 4, 128, 5, 32), (1, 2, 8, 64, 9, 1), (1, 2, 4, 64, 300, 16)],
)
def test_kernel_matches_naive(B, Hkv, G, D, P, T, dtype):
    q, kmin, kmax, lengths, _ = page_summaries(B, Hkv, G, D, P, T, seed=P + G, dtype=dtype)
    got = page_score_quest_triton(q, kmin, kmax, lengths, scale=0.3)
    want = page_score_quest_naive(q, kmin, kmax, lengths, scale=0.3)
    assert torch.equal(torch.isinf(got), lengths == 0) and torch.equal(torch.isinf(want), lengths == 0)
    f = lengths > 0
    torch.testing.assert_close(got[f], want[f], rtol=1e-5, atol=1e-5)


def test_quest_bound_is_an_upper_bound_of_every_key_score():
    B, Hkv, G, D, P, T = 2, 2, 4, 32, 5, 16
    q, kmin, kmax, lengths, keys = page_summaries(B, Hkv, G, D, P, T, seed=2)
    raw = page_raw_quest_naive(q, kmin, kmax, lengths, scale=1.0)
    scores = torch.einsum("bhgd,bhptd->bhgpt", q.view(B, Hkv, G, D), keys)
    valid = torch.arange(T) < lengths[..., None]
    best = scores.masked_fill(~valid[:, :, None], float("-inf")).amax(-1)
    f = (lengths > 0)[:, :, None].expand_as(best)
    assert torch.all(raw[f] >= best[f] - 1e-4)
    # a page of one key: the bound is that key's score
    one = lengths == 1
    torch.testing.assert_close(raw[one[:, :, None].expand_as(raw)], best[one[:, :, None].expand_as(best)])


def test_a_head_without_pages_scores_minus_inf_everywhere():
    lengths = torch.tensor([[[3, 2, 0], [0, 0, 0]]])
    q, kmin, kmax, lengths, _ = page_summaries(1, 2, 4, 16, 3, 4, seed=5, lengths=lengths)
    for got in (
        page_score_quest_triton(q, kmin, kmax, lengths),
        page_score_quest_naive(q, kmin, kmax, lengths),
    ):
        assert torch.all(got[0, 1] == float("-inf")) and torch.isfinite(got[0, 0, :2]).all()
        torch.testing.assert_close(got[0, 0].exp().sum(), torch.tensor(1.0))


def test_mismatched_bounds_are_config_errors():
    q, kmin, kmax, lengths, _ = page_summaries(1, 2, 2, 16, 3, 4, seed=7)
    with pytest.raises(ConfigError, match="kmin and kmax"):
        page_score_quest(q, kmin, kmax[..., :8], lengths)
    with pytest.raises(ConfigError, match="page_len must be"):
        page_score_quest(q, kmin, kmax, lengths[..., :2])


def test_the_reference_is_the_elementwise_bound():
    """The reference computes sum_c max(q_c kmin_c, q_c kmax_c) as two products over the pages (q's
    positive part with kmax, its negative part with kmin): the same numbers as the element-wise maximum."""
    B, Hkv, G, D, P, T = 2, 3, 2, 64, 40, 8
    q, kmin, kmax, lengths, _ = page_summaries(B, Hkv, G, D, P, T, seed=11)
    raw = page_raw_quest_naive(q, kmin, kmax, lengths, scale=0.5)
    qf = q.view(B, Hkv, G, 1, D)
    want = torch.maximum(qf * kmin[:, :, None], qf * kmax[:, :, None]).sum(-1) * 0.5
    want = want.masked_fill((lengths <= 0)[:, :, None], float("-inf"))
    torch.testing.assert_close(raw, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_a_page_scale_scores_the_scaled_bounds(backend, monkeypatch):
    """Int8 levels with one scale per page (a compact record) score what their dequantised bounds score,
    on the reference and on the Triton path."""
    monkeypatch.setenv("MM_OVAL_KERNELS", "torch" if backend == "naive" else "triton")
    q, kmin, kmax, lengths, _ = page_summaries(1, 2, 4, 32, 12, 8, seed=13)
    s = torch.maximum(kmin.abs(), kmax.abs()).amax(-1).clamp_min(1e-3) / 100  # levels within int8
    lo, hi = torch.floor(kmin / s[..., None]), torch.ceil(kmax / s[..., None])
    got = page_score_quest(q, lo.to(torch.int8), hi.to(torch.int8), lengths, 0.2, s.half())
    want = page_score_quest(
        q, lo * s.half().float()[..., None], hi * s.half().float()[..., None], lengths, 0.2
    )
    f = lengths > 0
    torch.testing.assert_close(got[f], want[f], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(got), ~f)
