"""LOCKS / OVAL page bases and Quest bounds as tensor functions: the bases are the eigenvectors the
papers define, the kernels' scores of them estimate the page's attention mass, and the selection
measures are right."""

import math

import pytest
import torch
from mm_oval.kernels.common.gqa import combine_gqa
from mm_oval.kernels.lowrank_score.naive import page_raw_lowrank_naive
from mm_oval.kernels.quest_score.naive import page_raw_quest_naive

from mm_oval.errors import ConfigError
from mm_oval.measures import attention_mass_captured, exact_page_log_mass, read_tokens
from mm_oval.policies.page_summaries import PageBasisSummary, key_bounds, output_metric, page_bases

B, HKV, HQ, P, T, D = 2, 2, 4, 5, 16, 32


def basis_scores(query: torch.Tensor, s: PageBasisSummary, scaling: float) -> torch.Tensor:
    """The page_score_lowrank kernel's per-query-head score of the summaries, (B, Hq, P)."""
    page_len = s.token_mask.sum(-1)
    raw = page_raw_lowrank_naive(query, s.centroid, s.basis, s.coeffs, page_len, scaling)
    return raw.reshape(query.shape[0], query.shape[1], -1)


def quest_scores(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """The page_score_quest kernel's per-query-head bound of the pages' key bounds, (B, Hq, P)."""
    kmin, kmax = key_bounds(keys, mask)
    raw = page_raw_quest_naive(query, kmin, kmax, mask.sum(-1), scaling)
    return raw.reshape(query.shape[0], query.shape[1], -1)


def _direct_basis(k, v, g, eta, rank):
    """Top-r eigenvectors of M_eta built in D x D (the definition), for comparison with the Gram route."""
    x = k - k.mean(-2, keepdim=True)
    y = v - v.mean(-2, keepdim=True)
    m1 = x.transpose(-1, -2) @ x
    m1 = m1 / m1.diagonal(dim1=-1, dim2=-2).sum(-1)[..., None, None]
    m2 = x.transpose(-1, -2) @ y @ g @ y.transpose(-1, -2) @ x
    m2 = m2 / m2.diagonal(dim1=-1, dim2=-2).sum(-1)[..., None, None]
    _, vec = torch.linalg.eigh((1 - eta) * m1 + eta * m2)
    return vec[..., -rank:]


@pytest.mark.parametrize("eta", [0.0, 0.25, 0.5, 1.0])
def test_gram_route_gives_the_top_eigenvectors_of_m_eta(eta):
    torch.manual_seed(0)
    k, v = torch.randn(B, HKV, P, T, D), torch.randn(B, HKV, P, T, D)
    g = output_metric(torch.randn(64, HQ * D), HQ, HKV)[None, :, None]
    s = page_bases(k, rank=8, eta=eta, values=v, metric=g)
    ref = _direct_basis(k.double(), v.double(), g.double(), eta, 8).float()
    # same subspace (eigenvectors are defined up to sign), orthonormal columns
    proj = s.basis @ s.basis.transpose(-1, -2)
    assert torch.allclose(proj, ref @ ref.transpose(-1, -2), atol=1e-4)
    assert torch.allclose(
        s.basis.transpose(-1, -2) @ s.basis, torch.eye(8).expand(B, HKV, P, 8, 8), atol=1e-4
    )
    assert torch.allclose(s.coeffs, (k - s.centroid.unsqueeze(-2)) @ s.basis, atol=1e-4)


def test_oval_basis_differs_from_key_pca_when_the_output_metric_is_skewed():
    torch.manual_seed(1)
    k, v = torch.randn(1, 1, 3, T, D), torch.randn(1, 1, 3, T, D)
    w = torch.zeros(16, D)
    w[:, :4] = 5.0 * torch.randn(16, 4)  # o_proj reads only 4 value channels
    g = output_metric(w, 1, 1)[None, :, None]
    locks = page_bases(k, rank=4)
    oval = page_bases(k, rank=4, eta=1.0, values=v, metric=g)
    gap = (
        (locks.basis @ locks.basis.transpose(-1, -2) - oval.basis @ oval.basis.transpose(-1, -2)).abs().max()
    )
    assert gap > 0.1


def test_output_metric_sums_w_g_transpose_w_g_over_each_group():
    torch.manual_seed(2)
    w = torch.randn(24, HQ * 8)
    g = output_metric(w, HQ, HKV)
    for h in range(HKV):
        want = sum(w[:, q * 8 : (q + 1) * 8].T @ w[:, q * 8 : (q + 1) * 8] for q in (2 * h, 2 * h + 1))
        assert torch.allclose(g[h], want, atol=1e-4)
    with pytest.raises(ConfigError, match="query heads"):
        output_metric(torch.randn(24, 30), 4, 2)


def test_full_rank_basis_scores_equal_the_exact_page_log_mass():
    torch.manual_seed(3)
    k = torch.randn(B, HKV, P, 8, D)  # centred 8-token pages have rank <= 7 < 8
    q = torch.randn(B, HQ, D)
    mask = torch.ones(B, HKV, P, 8, dtype=torch.bool)
    for eta in (0.0, 0.5):
        s = page_bases(k, rank=8, eta=eta, values=torch.randn_like(k), metric=torch.eye(D))
        assert torch.allclose(
            basis_scores(q, s, D**-0.5), exact_page_log_mass(q, k, mask, D**-0.5), atol=1e-4
        )


def test_partly_filled_pages_ignore_empty_slots_and_empty_pages_score_minus_inf():
    torch.manual_seed(4)
    k = torch.randn(1, 1, 3, 8, D)
    mask = torch.ones(1, 1, 3, 8, dtype=torch.bool)
    mask[0, 0, 1, 5:] = False
    mask[0, 0, 2] = False
    garbage = k.clone()
    garbage[~mask] = 1e3  # whatever sits in empty slots must not matter
    q = torch.randn(1, 2, D)
    s = page_bases(garbage, mask, rank=8)
    got = basis_scores(q, s, 0.2)
    want = exact_page_log_mass(q, k, mask, 0.2)
    assert torch.allclose(got[..., :2], want[..., :2], atol=1e-4)
    assert torch.isinf(got[..., 2]).all() and (got[..., 2] < 0).all()
    qs = quest_scores(q, garbage, mask, 0.2)
    assert torch.isinf(qs[..., 2]).all()


def test_low_rank_scores_track_the_exact_mass_better_than_the_centroid_alone():
    torch.manual_seed(5)
    # keys with a dominant per-page direction: rank-2 bases should explain most of the spread
    dirs = torch.randn(1, 1, 16, 1, D)
    k = torch.randn(1, 1, 16, T, 1) * 3.0 * dirs + 0.3 * torch.randn(1, 1, 16, T, D)
    q = torch.randn(1, 2, D) * 2
    mask = torch.ones(1, 1, 16, T, dtype=torch.bool)
    exact = exact_page_log_mass(q, k, mask, D**-0.5)
    rank2 = basis_scores(q, page_bases(k, rank=2), D**-0.5)
    # the centroid alone (every key replaced by the page mean) is the rank-0 estimate
    centroid_score = torch.einsum("bhd,bpd->bhp", q, k[:, 0].mean(-2)) * D**-0.5 + math.log(T)
    assert (rank2 - exact).abs().mean() < 0.5 * (centroid_score - exact).abs().mean()


def test_quest_bound_is_an_upper_bound_of_every_key_in_the_page():
    torch.manual_seed(6)
    k = torch.randn(B, HKV, P, T, D)
    q = torch.randn(B, HQ, D)
    s = quest_scores(q, k, torch.ones(k.shape[:-1], dtype=torch.bool), 1.0)
    qk = torch.einsum("bhgd,bhptd->bhgpt", q.reshape(B, HKV, 2, D), k).amax(-1).reshape(B, HQ, P)
    assert (s >= qk - 1e-4).all()


def test_group_combination_is_a_distribution_over_pages_per_kv_head():
    scores = torch.tensor(
        [[[0.0, 1.0, float("-inf")], [2.0, 0.0, float("-inf")]]]
    )  # 2 query heads, 1 KV head
    c = combine_gqa(scores[:, None])  # (B, Hkv, G, P)
    assert c.shape == (1, 1, 3)
    assert torch.allclose(c.exp().sum(-1), torch.ones(1, 1))
    assert c[0, 0, 2] == float("-inf")
    want = 0.5 * (torch.softmax(torch.tensor([0.0, 1.0]), 0) + torch.softmax(torch.tensor([2.0, 0.0]), 0))
    assert torch.allclose(c[0, 0, :2].exp(), want)


def test_mass_captured_is_one_with_every_page_and_counts_only_read_tokens():
    attn = torch.tensor([[[0.5, 0.1, 0.3, 0.1]]])  # 1 query head
    token_page = torch.tensor([[[0, 0, 1, -1]]])  # last token sits in the open page: always read
    everything = read_tokens(token_page, torch.tensor([[[0, 1]]]))
    assert attention_mass_captured(attn, everything).item() == pytest.approx(1.0)
    only_1 = read_tokens(token_page, torch.tensor([[[1, -1]]]))
    assert only_1.tolist() == [[[False, False, True, True]]]
    assert attention_mass_captured(attn, only_1).item() == pytest.approx(0.4)
    # the top-2 tokens hold 0.8; page 1 holds 0.3 of it
    assert attention_mass_captured(attn, only_1, top=2).item() == pytest.approx(0.3 / 0.8)


def test_bad_knobs_raise_config_errors():
    k = torch.randn(1, 1, 2, 4, 8)
    with pytest.raises(ConfigError, match="eta"):
        page_bases(k, eta=1.5)
    with pytest.raises(ConfigError, match="rank"):
        page_bases(k, rank=0)
    with pytest.raises(ConfigError, match="values"):
        page_bases(k, eta=0.5)


def _page_batch(keys, mask, module=None, first_page=0):
    from mm_oval.policies.base import IMAGE, PageBatch

    kind = torch.full(keys.shape[:3], IMAGE, dtype=torch.int8)
    return PageBatch(0, keys, torch.randn_like(keys), mask, kind, first_page, module)


@pytest.mark.parametrize("name,options", [("locks", {}), ("oval", {"eta": 0.25}), ("oval", {"eta": 1.0})])
def test_policies_summarize_batches_of_pages_that_concatenate_and_score_like_the_exact_mass(
    name, options, tiny_random_llava
):
    from mm_oval.policies.base import DecodeContext, make_retrieval

    model, _ = tiny_random_llava
    module = model.model.language_model.layers[1].self_attn
    d = module.head_dim
    policy = make_retrieval(name, rank=8, coef_rows=16, summary_format="float", **options)  # exact
    torch.manual_seed(7)
    # prompt pages of 4 tokens (image tiles, one partly evicted), then a closed 8-token decode page
    k1 = torch.randn(1, 2, 3, 4, d)
    m1 = torch.ones(1, 2, 3, 4, dtype=torch.bool)
    m1[0, 1, 2, 3] = False
    k1[~m1] = 0
    k2 = torch.randn(1, 2, 1, 8, d)
    m2 = torch.ones(1, 2, 1, 8, dtype=torch.bool)
    parts = [policy.summarize(_page_batch(k1, m1, module)), policy.summarize(_page_batch(k2, m2, module, 3))]
    summaries = {key: torch.cat([p[key] for p in parts], 2) for key in parts[0]}
    page_len = torch.cat([m1.sum(-1), m2.sum(-1)], 2)
    q = torch.randn(1, 4, 1, d)
    ctx = DecodeContext(
        layer_idx=1,
        query=q,
        summaries=summaries,
        page_start=torch.zeros_like(page_len),
        page_len=page_len,
        page_kind=torch.ones_like(page_len, dtype=torch.int8),
        candidates=torch.ones_like(page_len, dtype=torch.bool),
        scaling=d**-0.5,
        module=module,
    )
    got = policy.score_pages(ctx)
    # pages of <= 8 tokens have centred rank <= 7 < 8: every basis is exact, so the score is the exact
    # group-combined log attention mass whatever eta is
    full_keys = torch.zeros(1, 2, 4, 8, d)
    full_keys[:, :, :3, :4] = k1
    full_keys[:, :, 3] = k2[:, :, 0]
    full_mask = torch.zeros(1, 2, 4, 8, dtype=torch.bool)
    full_mask[:, :, :3, :4] = m1
    full_mask[:, :, 3] = True
    exact = exact_page_log_mass(q[:, :, 0], full_keys, full_mask, d**-0.5)  # (B, Hq, P)
    want = combine_gqa(exact.reshape(1, 2, 2, -1))
    assert got.shape == (1, 2, 4)
    assert torch.allclose(got, want, atol=1e-4)
    chosen = policy.select(ctx, 0.5)
    assert chosen.sum(-1).tolist() == [[2, 2]]
    assert torch.equal(chosen, want.argsort(-1, descending=True).argsort(-1) < 2)


def test_oval_needs_the_layer_module_and_pages_must_fit_the_coefficient_store():
    from mm_oval.policies.base import make_retrieval

    k = torch.randn(1, 1, 2, 8, 16)
    m = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    with pytest.raises(ConfigError, match="module"):
        make_retrieval("oval").summarize(_page_batch(k, m))
    with pytest.raises(ConfigError, match="coef_rows"):
        make_retrieval("locks", coef_rows=4).summarize(_page_batch(k, m))
    with pytest.raises(ConfigError, match="eta"):
        make_retrieval("oval", eta=2)
    with pytest.raises(ConfigError, match="eta"):
        make_retrieval("locks", eta=0.5)


def test_the_former_spelling_max_page_tokens_still_sets_coef_rows_with_a_warning():
    from mm_oval.policies.base import make_retrieval

    with pytest.warns(FutureWarning, match="now called coef_rows"):
        policy = make_retrieval("oval", max_page_tokens=16)
    assert policy.coef_rows == 16 and policy.max_page_tokens is None
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="coef_rows=4"):
        make_retrieval("locks", max_page_tokens=4).summarize(
            _page_batch(torch.randn(1, 1, 2, 8, 16), torch.ones(1, 1, 2, 8, dtype=torch.bool))
        )
