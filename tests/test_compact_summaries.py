"""Compact page summaries (retrieval option summary_format="compact"): LOCKS / OVAL records with an int4
basis and int8 coefficients and centroid, Quest bounds in int8 rounded outward. The quantisers stay within
their error bound, the compact scores pick the pages the float ones pick, Quest's compact score is still an
upper bound, and the stats count the smaller records (bytes read and bytes allocated)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mm_oval.kernels.lowrank_score.naive import page_raw_lowrank_naive
from mm_oval.kernels.quest_score.naive import page_raw_quest_naive

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError
from mm_oval.policies.base import make_retrieval
from mm_oval.policies.page_summaries import (
    compact_basis_bytes,
    compact_key_bounds,
    compact_page_bases,
    dequantize_int4_columns,
    dequantize_int8,
    expand_key_bounds,
    expand_page_bases,
    key_bounds,
    page_bases,
    quantize_int4_columns,
    quantize_int8,
    scoring_operands,
)
from mm_oval.stats import get_stats
from mm_oval.wrapper import new_cache, wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")

D = 128
TEXTS = ["USER: <image>\nwhat color is the circle ? ASSISTANT:", "USER: <image>\nhow many ? ASSISTANT:"]


# ---- the quantisers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [128, 33])
def test_int4_columns_pack_two_per_byte_and_come_back_within_half_a_step(d):
    torch.manual_seed(0)
    x = torch.randn(3, 5, d, 8) * torch.tensor([1.0, 0.1, 3.0, 1e-3, 1.0, 1.0, 0.5, 2.0])
    x[..., 5] = 0.0  # an all-zero column
    packed, scale = quantize_int4_columns(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, (d + 1) // 2, 8)
    assert scale.dtype == torch.float16 and scale.shape == (3, 5, 8)
    back = dequantize_int4_columns(packed, scale, d)
    assert back.shape == x.shape
    step = scale.float().unsqueeze(-2)
    assert ((back - x).abs() <= step / 2 + 1e-7 * x.abs()).all()
    assert (7 * scale.float() >= x.abs().amax(-2)).all()  # no value beyond the levels
    assert (back[..., 5] == 0).all() and (scale[..., 5] == 0).all()
    # the levels themselves come back exactly, in their rows (the packing keeps the order)
    levels = torch.arange(-7, 8).float()
    y = levels[torch.randint(0, 15, (d, 4))] * 0.25
    y[0] = torch.tensor([7.0, -7.0, 7.0, -7.0]) * 0.25
    assert torch.equal(dequantize_int4_columns(*quantize_int4_columns(y), d), y)


def test_int8_groups_come_back_within_half_a_step():
    torch.manual_seed(1)
    x = torch.randn(4, 6, 32, 8) * torch.logspace(-3, 2, 6)[:, None, None]
    q, scale = quantize_int8(x, 2)
    assert q.dtype == torch.int8 and scale.shape == (4, 6) and scale.dtype == torch.float16
    back = dequantize_int8(q, scale)
    step = scale.float()[..., None, None]
    assert ((back - x).abs() <= step / 2 + 1e-7 * x.abs()).all()
    assert (127 * scale.float() >= x.abs().amax((-1, -2))).all()
    assert (q.abs() <= 127).all()
    zero_q, zero_s = quantize_int8(torch.zeros(2, 5), 1)
    assert (zero_s == 0).all() and (dequantize_int8(zero_q, zero_s) == 0).all()


def test_a_compact_record_is_the_float_summary_within_the_quantisers_bounds():
    torch.manual_seed(2)
    keys = torch.randn(2, 3, 10, 16, D) + torch.randn(1, 3, 1, 1, D) * 3
    s = page_bases(keys, rank=8)
    rec = compact_page_bases(s.centroid, s.basis, s.coeffs)
    assert {k: v.dtype for k, v in rec.items()} == {
        "mu_q": torch.int8,
        "mu_scale": torch.float16,
        "basis_q": torch.uint8,
        "basis_scale": torch.float16,
        "coef_q": torch.int8,
        "coef_scale": torch.float16,
    }
    assert all(v.shape[:3] == (2, 3, 10) for v in rec.values())
    mu, basis, coef = expand_page_bases(rec)
    mu_step = rec["mu_scale"].float()[..., None]
    basis_step = rec["basis_scale"].float()[..., None, :]
    coef_step = rec["coef_scale"].float()[..., None, None]
    assert ((mu - s.centroid).abs() <= mu_step / 2 + 1e-6).all()
    assert ((basis - s.basis).abs() <= basis_step / 2 + 1e-6).all()
    assert ((coef - s.coeffs).abs() <= coef_step / 2 + 1e-6).all()
    # the steps are those of the data: 1/127 of the page's largest centroid entry, 1/7 of a column's largest
    assert torch.allclose(mu_step[..., 0], s.centroid.abs().amax(-1) / 127, rtol=2e-3)
    assert torch.allclose(basis_step[..., 0, :], s.basis.abs().amax(-2) / 7, rtol=2e-3)


# ---- compact scores pick the pages the float scores pick --------------------------------------------


def _keys(kind: str, t: int, g: torch.Generator) -> torch.Tensor:
    """(B, Hkv, P, T, D) keys: i.i.d. Gaussian, or structured like a layer's (a shared offset with a few
    large channels, a per-page centre, three directions of variation within a page, small noise)."""
    shape = (2, 4, 144, t, D)
    if kind == "random":
        return torch.randn(shape, generator=g)
    base = torch.randn(1, 4, 1, 1, D, generator=g) * 2
    base[..., :8] *= 5
    centre = torch.randn(2, 4, 144, 1, D, generator=g) * 0.7
    dirs = torch.randn(2, 4, 144, 3, D, generator=g)
    within = torch.randn(2, 4, 144, t, 3, generator=g) @ dirs * 0.5
    return base + centre + within + 0.1 * torch.randn(shape, generator=g)


def _top_overlap(a: torch.Tensor, b: torch.Tensor, frac: float = 0.25) -> torch.Tensor:
    """Per row: the share of a's top `frac` pages that are also among b's."""
    k = math.ceil(frac * a.shape[-1])
    top_a = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(k, -1).indices, True)
    top_b = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, b.topk(k, -1).indices, True)
    return (top_a & top_b).sum(-1).float() / k


def _scores(q, mu, basis, coef, t):
    page_len = torch.full(mu.shape[:3], t)
    return page_raw_lowrank_naive(q, mu, basis, coef, page_len, D**-0.5)


def _swap_nibbles(rec):
    p = rec["basis_q"]
    return {**rec, "basis_q": (p >> 4) | (p << 4)}


@pytest.mark.parametrize("kind", ["random", "structured"])
@pytest.mark.parametrize("t", [4, 16])
def test_compact_scores_pick_nearly_the_top_quarter_of_pages_the_float_scores_pick(kind, t):
    g = torch.Generator().manual_seed(3 + t)
    keys = _keys(kind, t, g)
    q = torch.randn(2, 8, D, generator=g) * 1.5
    s = page_bases(keys, rank=8)
    rec = compact_page_bases(s.centroid, s.basis, s.coeffs)
    exact = _scores(q, s.centroid, s.basis, s.coeffs, t)
    compact = _scores(q, *expand_page_bases(rec), t)
    overlap = _top_overlap(exact, compact)
    assert overlap.mean() >= 0.9 and overlap.min() >= 0.75
    # the measure tells a broken record: the basis rows read back in the wrong order (nibbles swapped)
    broken = _top_overlap(exact, _scores(q, *expand_page_bases(_swap_nibbles(rec)), t))
    assert broken.mean() < 0.9
    # what the policies hand the kernel (the column scales moved onto the coefficients) scores the same
    assert torch.allclose(_scores(q, *scoring_operands(rec), t), compact, atol=1e-4, rtol=1e-5)


# ---- Quest: the compact bound is still an upper bound -----------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(1, 16),
    magnitude=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 1e4]),
    outliers=st.booleans(),
)
def test_quest_compact_bounds_are_outward_and_keep_the_score_an_upper_bound(seed, t, magnitude, outliers):
    g = torch.Generator().manual_seed(seed)
    p, d = 6, 16
    keys = torch.randn(1, 2, p, t, d, generator=g) * magnitude
    if outliers:
        keys[..., :2] *= 100
    mask = torch.rand(1, 2, p, t, generator=g) < 0.8
    mask[..., 0] = True
    mask[0, 0, 0] = False  # one empty page
    kmin, kmax = key_bounds(keys, mask)
    rec = compact_key_bounds(kmin, kmax)
    assert rec["kmin_q"].dtype == torch.int8 and rec["bound_scale"].dtype == torch.float16
    lo, hi = expand_key_bounds(rec)
    assert (lo <= kmin).all() and (hi >= kmax).all()
    # no looser than one step each way
    step = rec["bound_scale"].float()[..., None]
    assert (kmin - lo <= step * (1 + 1e-6)).all() and (hi - kmax <= step * (1 + 1e-6)).all()
    q = torch.randn(1, 4, d, generator=g)
    plen = mask.sum(-1)
    bound = page_raw_quest_naive(q, lo, hi, plen, 1.0)  # (1, 2, 2, P)
    qk = torch.einsum("bhgd,bhptd->bhgpt", q.view(1, 2, 2, d), keys).masked_fill(~mask[:, :, None], -math.inf)
    best = qk.amax(-1)
    real = plen[:, :, None] > 0
    tol = 1e-5 * (q.abs().sum(-1).view(1, 2, 2, 1) * torch.maximum(lo.abs(), hi.abs()).amax(-1)[:, :, None])
    assert (bound[real.expand_as(bound)] >= (best - tol)[real.expand_as(bound)]).all()
    assert (bound >= page_raw_quest_naive(q, kmin, kmax, plen, 1.0) - tol).all()


# ---- the policies: options, bytes, summaries in the cache -------------------------------------------


@pytest.mark.parametrize("name", ["locks", "oval", "quest"])
def test_a_bad_summary_format_names_the_option_and_its_choices(name):
    with pytest.raises(ConfigError, match=r"summary_format must be one of 'float', 'compact', got 'int4'"):
        make_retrieval(name, summary_format="int4")
    # the default: compact for LOCKS / OVAL (as their authors' code stores them), float for Quest (as its does)
    assert make_retrieval(name).summary_format == ("float" if name == "quest" else "compact")


def test_a_bad_summary_format_in_a_spec_is_refused_when_wrapping(tiny_random_llava):
    model, _ = tiny_random_llava
    cfg = OvalConfig.from_spec("oval:summary_format=int8", 0.25)
    assert cfg.retrieval_options == {"summary_format": "int8"}
    with pytest.raises(ConfigError, match="oval: retrieval option summary_format must be one of"):
        mm_oval.wrap(model, cfg)
    assert not mm_oval.is_wrapped(model)


def _independent_compact_bytes(summaries: dict, page_len: torch.Tensor) -> torch.Tensor:
    """Per page, from the stored tensors' own sizes: every entry of each per-page tensor, except that only
    the coefficient rows of the page's tokens count."""
    per_page = 0
    for name, t in summaries.items():
        if name != "coef_q":
            per_page += math.prod(t.shape[3:]) * t.element_size()
    r = summaries["coef_q"].shape[-1]
    return per_page + page_len.long() * r * summaries["coef_q"].element_size()


@pytest.mark.parametrize("name", ["locks", "oval"])
def test_compact_summary_bytes_count_the_packed_basis_the_tokens_coefficients_the_centroid_and_scales(name):
    torch.manual_seed(4)
    pol = make_retrieval(name, summary_format="compact")
    keys, values = torch.randn(1, 2, 5, 16, D), torch.randn(1, 2, 5, 16, D)
    mask = torch.arange(16) < torch.tensor([16, 4, 1, 9, 16]).view(5, 1)
    mask = mask.expand(1, 2, 5, 16)

    class _Module:  # the part of an attention module OVAL reads: o_proj, head_dim, the group size
        o_proj = torch.nn.Linear(4 * D, 64, bias=False)
        head_dim, num_key_value_groups = D, 2

    from mm_oval.policies.base import PageBatch

    batch = PageBatch(
        layer_idx=0, keys=keys, values=values, mask=mask, kind=torch.zeros(1, 2, 5, dtype=torch.int8),
        first_page=0, module=_Module(),
    )  # fmt: skip
    sm = pol.summarize(batch)
    assert sm["coef_q"].shape == (1, 2, 5, 32, 8)  # padded to coef_rows like the float record
    assert (sm["coef_q"][..., 16:, :] == 0).all() and (sm["coef_q"][..., :16, :][~mask] == 0).all()
    plen = mask.sum(-1)
    got = pol.summary_bytes(sm, plen)
    assert torch.equal(got, _independent_compact_bytes(sm, plen))
    # D = 128, r = 8: 512 packed basis + 16 column scales + 8 per token + 2 + 128 centroid + 2
    assert got[0, 0].tolist() == [660 + 8 * n for n in (16, 4, 1, 9, 16)]
    assert torch.equal(got, compact_basis_bytes(D, 8, plen))
    flt = make_retrieval(name, summary_format="float")
    assert (flt.summary_bytes(flt.summarize(batch), plen) > got).all()


def _run(model, inputs, retrieval, **options):
    """Generate 5 tokens (text pages of 2 tokens: decode closes pages) through the wrapped model, logging
    every selection's candidates and page lengths; -> (cache, log, stats)."""
    cfg = OvalConfig(
        retrieval=retrieval, retrieval_options=options, read_budget=0.25, text_page_size=2, read_scope="all"
    )
    mm_oval.wrap(model, cfg)
    log = []
    policy = wrap_info(model).retrieval
    select = policy.select

    def logged(ctx, budget):
        log.append({"cand": ctx.candidates, "plen": ctx.page_len, "summaries": dict(ctx.summaries)})
        return select(ctx, budget)

    policy.select = logged
    try:
        cache = new_cache(model)
        model.generate(**inputs, max_new_tokens=5, do_sample=False, cache=cache)
        return cache, log, get_stats(model)
    finally:
        mm_oval.unwrap(model)


@pytest.mark.parametrize("name", ["oval", "quest"])
def test_a_wrapped_model_holds_and_reads_the_compact_records(tiny_random_llava, llava_batch, name):
    model, _ = tiny_random_llava
    inputs = llava_batch(TEXTS)
    flt_cache, _, flt = _run(model, inputs, name, summary_format="float")
    cmp_cache, log, cmp = _run(model, inputs, name, summary_format="compact")
    d = cmp_cache.layers[0].keys.shape[-1]
    for fl, cl in zip(flt_cache.layers, cmp_cache.layers, strict=True):
        # the same pages summarised, prompt pages and those decode closed (concatenated on the page dim)
        p_f = {t.shape[2] for t in fl.summaries.values()}
        p_c = {t.shape[2] for t in cl.summaries.values()}
        assert p_f == p_c and len(p_c) == 1
        assert p_c.pop() > fl.prompt_pages  # decode closed some pages
    # allocated summaries shrink by the record sizes' factor (fp32 float records: the tiny model is fp32)
    if name == "oval":
        r, t_max = 8, 32
        per_float = (d + d * r + t_max * r) * 4
        per_compact = d + 2 + (d + 1) // 2 * r + 2 * r + t_max * r + 2
    else:
        per_float, per_compact = 2 * d * 4, 2 * d + 2
    f_bytes, c_bytes = flt["allocated_bytes"]["summaries"], cmp["allocated_bytes"]["summaries"]
    pages = sum(math.prod(next(iter(lay.summaries.values())).shape[:3]) for lay in cmp_cache.layers)
    assert f_bytes == pages * per_float and c_bytes == pages * per_compact
    assert c_bytes / f_bytes == pytest.approx(per_compact / per_float)
    # bytes read: the compact records of the candidate pages, as an independent count makes them
    if name == "oval":
        expected = sum(
            int(_independent_compact_bytes(e["summaries"], e["plen"])[e["cand"]].sum()) for e in log
        )
    else:
        expected = sum(int(e["cand"].sum()) * (2 * d + 2) for e in log)
    assert cmp["bytes_read"]["total"]["summaries"] == expected > 0
    assert cmp["bytes_read"]["total"]["summaries"] < flt["bytes_read"]["total"]["summaries"]


@pytest.mark.parametrize("name", ["locks", "quest"])
def test_reading_every_page_with_compact_records_equals_the_unwrapped_model(
    tiny_random_llava, llava_batch, name
):
    model, _ = tiny_random_llava
    inputs = llava_batch(TEXTS)
    plain = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    cfg = OvalConfig(retrieval=name, retrieval_options={"summary_format": "compact"}, read_budget=1.0)
    wrapped = mm_oval.wrap(model, cfg)
    try:
        assert wrapped.generate(**inputs, max_new_tokens=4, do_sample=False).tolist() == plain.tolist()
    finally:
        mm_oval.unwrap(wrapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quest_float_bounds_are_the_keys_min_and_max_in_the_keys_dtype(dtype):
    """Quest's float record is stored as its authors store it, in the keys' dtype: 2 D values per page of
    that dtype (half of fp32 on an fp16 / bf16 model), and exactly the keys' channel-wise min and max."""
    from mm_oval.policies.base import PageBatch

    g = torch.Generator().manual_seed(3)
    keys = (torch.randn(1, 2, 4, 8, D, generator=g) * 3).to(dtype)
    mask = (torch.arange(8) < torch.tensor([8, 3, 1, 5]).view(4, 1)).expand(1, 2, 4, 8)
    batch = PageBatch(
        layer_idx=0, keys=keys, values=keys, mask=mask, kind=torch.zeros(1, 2, 4, dtype=torch.int8), first_page=0,
        module=None,
    )  # fmt: skip
    pol = make_retrieval("quest")
    sm = pol.summarize(batch)
    assert sm["kmin"].dtype == dtype and sm["kmax"].dtype == dtype
    m = mask.unsqueeze(-1)
    assert torch.equal(sm["kmin"], keys.masked_fill(~m, float("inf")).amin(-2))
    assert torch.equal(sm["kmax"], keys.masked_fill(~m, float("-inf")).amax(-2))
    plen = mask.sum(-1)
    assert (pol.summary_bytes(sm, plen) == 2 * D * keys.element_size()).all()
