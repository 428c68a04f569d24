"""OVAL's Y G Y^T multiplies a head's pages by G once (no D x D copy of G per page) and gives what the
broadcasting formula gives."""

import torch

from mm_oval.policies.page_summaries import output_metric, page_bases


def _pages(seed: int, B=2, H=2, P=5, T=6, D=16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, P, T, D, generator=g)
    v = torch.randn(B, H, P, T, D, generator=g)
    mask = torch.rand(B, H, P, T, generator=g) > 0.2
    mask[..., 0] = True
    w = torch.randn(3 * D, 2 * H * D, generator=g)  # o_proj of 2 query heads per KV head
    return k, v, mask, output_metric(w, 2 * H, H)[None, :, None]  # (1, H, 1, D, D)


def _old_ygyt(y, metric):
    return y @ metric @ y.transpose(-1, -2)  # the broadcasting formula: one D x D copy of G per page


def test_y_g_yt_without_a_copy_of_g_per_page_equals_the_broadcast_formula(monkeypatch):
    from mm_oval.policies import page_summaries as ps

    k, v, mask, metric = _pages(0)
    y = torch.randn(*k.shape)
    assert torch.allclose(ps._metric_gram(y, metric), _old_ygyt(y, metric), rtol=1e-5, atol=1e-4)
    # a metric per page (not shared) still takes the per-page product
    per_page = metric.expand(2, -1, k.shape[2], -1, -1).contiguous()
    assert torch.allclose(ps._metric_gram(y, per_page), _old_ygyt(y, per_page), rtol=1e-5, atol=1e-4)
    new = page_bases(k, mask, rank=4, eta=0.5, values=v, metric=metric)
    monkeypatch.setattr(ps, "_metric_gram", _old_ygyt)
    old = page_bases(k, mask, rank=4, eta=0.5, values=v, metric=metric)
    # the same bases up to each direction's sign (eigenvectors), hence the same coefficients' Gram
    dots = (new.basis * old.basis).sum(-2).abs()
    norms = new.basis.norm(dim=-2) * old.basis.norm(dim=-2)
    assert torch.allclose(dots, norms, rtol=1e-3, atol=1e-4)
    assert torch.allclose(new.centroid, old.centroid)
