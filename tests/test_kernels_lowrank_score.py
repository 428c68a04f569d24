"""LOCKS / OVAL page scoring: the Triton kernel (interpreter on CPU) against naive.py, the reference
against the attention mass it estimates, and the GQA combination (common.gqa) it shares with Quest."""

from __future__ import annotations

import pytest
import torch
from mm_oval.kernels import page_score_lowrank
from mm_oval.kernels.common.gqa import combine_gqa
from mm_oval.kernels.common.triton_utils import combine_gqa_triton
from mm_oval.kernels.lowrank_score.kernel import page_score_lowrank_triton
from mm_oval.kernels.lowrank_score.naive import page_raw_lowrank_naive, page_score_lowrank_naive

from mm_oval.errors import ConfigError


def summaries(B, Hkv, G, D, P, T, R, seed, dtype=torch.float32, lengths=None):
    """Exact LOCKS summaries of random pages (centroid, top-R PCA basis, coefficients), with page
    lengths 1..T, one empty slot at the end."""
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
    cast = [t.to(dtype) for t in (q, mu, basis, coef)]
    return (*cast, lengths.to(torch.int32), keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "B, Hkv, G, D, P, T, R",
    [(1, 2, 1, 64, 6, 16, 8), (3, 1, 4, 128, 5, 32, 8), (1, 2, 8, 64, 9, 1, 4), (1, 2, 4, 64, 20, 16, 8)],
)
def test_kernel_matches_naive(B, Hkv, G, D, P, T, R, dtype):
    q, mu, basis, coef, lengths, _ = summaries(B, Hkv, G, D, P, T, R, seed=P + G, dtype=dtype)
    got = page_score_lowrank_triton(q, mu, basis, coef, lengths)
    want = page_score_lowrank_naive(q, mu, basis, coef, lengths)
    assert torch.equal(torch.isinf(got), lengths == 0) and torch.equal(torch.isinf(want), lengths == 0)
    f = lengths > 0
    torch.testing.assert_close(got[f], want[f], rtol=1e-5, atol=1e-5)


def test_full_rank_basis_gives_the_exact_page_attention_mass():
    """With R = D the basis reconstructs every key, so the score is log sum_i exp(scale q.k_i)."""
    B, Hkv, G, D, P, T = 1, 2, 2, 16, 4, 8
    q, mu, basis, coef, lengths, keys = summaries(B, Hkv, G, D, P, T, D, seed=1)
    raw = page_raw_lowrank_naive(q, mu, basis, coef, lengths, scale=0.25)  # (B, Hkv, G, P)
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


def test_gqa_combination_is_the_group_average_of_page_softmaxes():
    B, Hkv, G, D, P, T = 2, 2, 4, 32, 7, 8
    q, mu, basis, coef, lengths, _ = summaries(B, Hkv, G, D, P, T, 4, seed=3)
    raw = page_raw_lowrank_naive(q, mu, basis, coef, lengths)
    combined = page_score_lowrank_naive(q, mu, basis, coef, lengths)
    torch.testing.assert_close(combined.exp(), torch.softmax(raw, -1).mean(2))
    torch.testing.assert_close(combined.exp().sum(-1), torch.ones(B, Hkv))
    # with one query head per KV head the order of pages is the order of the raw scores
    q1, mu1, b1, c1, len1, _ = summaries(1, 3, 1, 32, 9, 8, 4, seed=4)
    one = page_score_lowrank_naive(q1, mu1, b1, c1, len1)
    raw1 = page_raw_lowrank_naive(q1, mu1, b1, c1, len1)[:, :, 0]
    for h in range(3):
        f = len1[0, h] > 0
        assert torch.equal(one[0, h][f].argsort(), raw1[0, h][f].argsort())


def test_a_head_without_pages_scores_minus_inf_everywhere():
    lengths = torch.tensor([[[3, 2, 0], [0, 0, 0]]])
    q, mu, basis, coef, lengths, _ = summaries(1, 2, 4, 16, 3, 4, 2, seed=5, lengths=lengths)
    for got in (
        page_score_lowrank_triton(q, mu, basis, coef, lengths),
        page_score_lowrank_naive(q, mu, basis, coef, lengths),
    ):
        assert torch.all(got[0, 1] == float("-inf")) and torch.isfinite(got[0, 0, :2]).all()


def test_triton_gqa_combination_matches_the_torch_one():
    g = torch.Generator().manual_seed(6)
    raw = torch.randn(2, 3, 4, 1500, generator=g) * 4  # more pages than one block of the combine kernel
    raw[0, 1] = float("-inf")  # a head without pages
    raw[1, :, :, 7] = float("-inf")  # an empty page
    got, want = combine_gqa_triton(raw), combine_gqa(raw)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    f = torch.isfinite(want)
    torch.testing.assert_close(got[f], want[f], rtol=1e-5, atol=1e-5)


def test_mismatched_summaries_are_config_errors():
    q, mu, basis, coef, lengths, _ = summaries(1, 2, 2, 16, 3, 4, 2, seed=7)
    with pytest.raises(ConfigError, match="basis must be"):
        page_score_lowrank(q, mu, basis[..., :8, :], coef, lengths)
    with pytest.raises(ConfigError, match="not a multiple"):
        page_score_lowrank(q[:, :3], mu, basis, coef, lengths)


@pytest.mark.parametrize(
    "B, Hkv, G, D, P, T, R",
    [(1, 2, 1, 64, 6, 16, 8), (2, 1, 4, 128, 5, 32, 8), (1, 2, 2, 33, 9, 4, 3), (1, 1, 1, 128, 70, 16, 8)],
)
def test_the_compact_kernel_reads_the_record_as_stored_and_scores_what_the_reference_scores(
    B, Hkv, G, D, P, T, R
):
    """The fused kernel unpacks the int4 basis (two rows a byte, odd D included), the int8 centroid and
    coefficients and their scales in registers and gives the reference's scores (which unpacks to fp32)."""
    from mm_oval.kernels import page_score_lowrank_compact
    from mm_oval.kernels.lowrank_score.kernel import page_score_lowrank_compact_triton
    from mm_oval.kernels.lowrank_score.record import compact_page_bases, scoring_operands

    q, mu, basis, coef, lengths, _ = summaries(B, Hkv, G, D, P, T, R, seed=D + P)
    rec = compact_page_bases(mu, basis, coef)
    got = page_score_lowrank_compact_triton(q, rec, lengths, scale=0.2)
    want = page_score_lowrank_naive(q, *scoring_operands(rec), lengths, scale=0.2)
    assert torch.equal(torch.isinf(got), lengths == 0) and torch.equal(torch.isinf(want), lengths == 0)
    f = lengths > 0
    torch.testing.assert_close(got[f], want[f], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        page_score_lowrank_compact(q, rec, lengths, 0.2)[f], want[f], rtol=1e-4, atol=1e-4
    )
    # a swapped nibble order would score other pages: the test can tell
    bad = dict(rec, basis_q=(rec["basis_q"] >> 4) | (rec["basis_q"] << 4))
    if D > 2 * R:
        assert not torch.allclose(
            page_score_lowrank_compact_triton(q, bad, lengths, 0.2)[f], want[f], atol=1e-3
        )


def test_a_compact_record_with_a_missing_part_is_a_config_error():
    from mm_oval.kernels import page_score_lowrank_compact
    from mm_oval.kernels.lowrank_score.record import compact_page_bases

    q, mu, basis, coef, lengths, _ = summaries(1, 1, 1, 16, 3, 4, 2, seed=1)
    rec = compact_page_bases(mu, basis, coef)
    with pytest.raises(ConfigError, match="lacks \\['coef_scale'\\]"):
        page_score_lowrank_compact(q, {k: v for k, v in rec.items() if k != "coef_scale"}, lengths)
    with pytest.raises(ConfigError, match="basis_q must be"):
        page_score_lowrank_compact(q, dict(rec, basis_q=rec["basis_q"][..., :3, :]), lengths)


def test_the_cpu_path_unpacks_the_basis_in_chunks_without_changing_a_score(monkeypatch):
    """Off CUDA the compact basis is unpacked a few KV heads at a time into one small buffer: the scores
    do not depend on how many chunks that takes (one head per chunk, a chunk across batch rows, one chunk)."""
    from mm_oval.kernels.lowrank_score import naive
    from mm_oval.kernels.lowrank_score.record import compact_page_bases, scoring_operands

    q, mu, basis, coef, lengths, _ = summaries(2, 3, 2, 33, 7, 8, 3, seed=11)
    rec = compact_page_bases(mu, basis, coef)
    want = page_score_lowrank_naive(q, *scoring_operands(rec), lengths, scale=0.2)
    f = lengths > 0
    per_head = 7 * 34 * 3  # one KV head's unpacked basis (P pages x 2 ceil(D/2) rows x R)
    for chunk in (1, per_head, 4 * per_head, 1 << 20):
        monkeypatch.setattr(naive, "UNPACK_CHUNK", chunk)
        got = naive.page_score_lowrank_compact_naive(q, rec, lengths, scale=0.2)
        assert torch.equal(torch.isinf(got), lengths == 0)
        torch.testing.assert_close(got[f], want[f], rtol=1e-4, atol=1e-4)
