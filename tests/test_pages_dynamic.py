"""OVAL's page sizing (page_sizing='dynamic'): pages chosen per layer and KV head from the keys, large over
uniform keys, cut around keys that differ, always a partition of the kept tokens into nested tiles."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.core import IMAGE, TEXT
from mm_oval.errors import ConfigError
from mm_oval.pages import PageSizing, dynamic_labels, layout_pages
from mm_oval.stats import get_stats

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = 8
N_TEXT_HEAD, N_TEXT_TAIL = 6, 5


def _prompt(batch: int = 1):
    """One 8x8 image between two text runs: modality, positions, image_rc, protected (nothing)."""
    n = N_TEXT_HEAD + GRID * GRID + N_TEXT_TAIL
    mod = torch.full((batch, n), TEXT)
    mod[:, N_TEXT_HEAD : N_TEXT_HEAD + GRID * GRID] = IMAGE
    rc = torch.full((batch, n, 3), -1)
    for i in range(GRID * GRID):
        rc[:, N_TEXT_HEAD + i] = torch.tensor([0, i // GRID, i % GRID])
    pos = torch.arange(n).expand(batch, n)
    return mod, pos, rc, torch.zeros(batch, n, dtype=torch.bool)


def _pages(keys, keep, sizing):
    mod, pos, rc, prot = _prompt(keys.shape[0])
    labels = dynamic_labels(keys, keep, mod, rc, sizing)
    return layout_pages(keep, mod, pos, rc, prot, 2, 16, labels=labels), rc


def _page_tokens(lay, b, h):
    """{page: [prompt index, ...]} of head (b, h)."""
    out: dict[int, list[int]] = {}
    for src, page in zip(lay.src[b, h].tolist(), lay.slot_page[b, h].tolist()):
        if src >= 0:
            out.setdefault(page, []).append(src)
    return out


def test_uniform_keys_make_the_largest_pages():
    keys = torch.ones(1, 1, N_TEXT_HEAD + GRID * GRID + N_TEXT_TAIL, 8)
    keep = torch.ones(1, 1, keys.shape[2], dtype=torch.bool)
    lay, _ = _pages(keys, keep, PageSizing(max_tokens=32))
    img = lay.page_len[0, 0][lay.page_kind[0, 0] == IMAGE]
    assert sorted(img.tolist()) == [32, 32]  # two 4x8 tiles
    txt = lay.page_len[0, 0][lay.page_kind[0, 0] == TEXT]
    assert txt.tolist() == [N_TEXT_HEAD + N_TEXT_TAIL]


def test_pages_are_cut_around_an_object_and_kept_whole_over_background():
    n = N_TEXT_HEAD + GRID * GRID + N_TEXT_TAIL
    keys = torch.zeros(1, 2, n, 8)
    obj = [N_TEXT_HEAD + r * GRID + c for r in (2, 3) for c in (2, 3)]
    keys[0, 0, obj, 0] = 5.0  # head 0 sees an object at rows 2-3, cols 2-3; head 1 sees uniform keys
    keep = torch.ones(1, 2, n, dtype=torch.bool)
    lay, _ = _pages(keys, keep, PageSizing(max_tokens=16, min_tokens=2, mean_tokens=4))
    pages0 = _page_tokens(lay, 0, 0)
    for toks in pages0.values():  # no page mixes the object with the background
        inside = [t in obj for t in toks]
        assert all(inside) or not any(inside)
    object_pages = [p for p, toks in pages0.items() if set(toks) <= set(obj)]
    assert sum(len(pages0[p]) for p in object_pages) == 4
    # the right half of the grid holds no object: its 4x4 tiles stay whole
    assert sorted(len(t) for t in pages0.values() if all((i - N_TEXT_HEAD) % GRID >= 4 for i in t)) == [
        16,
        16,
    ]
    # the other head's pages do not follow head 0's keys
    img1 = lay.page_len[0, 1][lay.page_kind[0, 1] == IMAGE]
    assert sorted(img1.tolist()) == [16, 16, 16, 16]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    split=st.sampled_from([0.0, 0.1, 0.5, 2.0]),
    max_tokens=st.sampled_from([4, 8, 16, 32]),
    min_tokens=st.sampled_from([1, 2, 4]),
    keep_share=st.sampled_from([1.0, 0.6]),
    mean_tokens=st.sampled_from([1, 4, 16]),
)
def test_dynamic_pages_partition_the_kept_tokens_into_nested_tiles(
    seed, split, max_tokens, min_tokens, keep_share, mean_tokens
):
    min_tokens = min(min_tokens, max_tokens)
    g = torch.Generator().manual_seed(seed)
    n = N_TEXT_HEAD + GRID * GRID + N_TEXT_TAIL
    # blocky keys: a few distinct values so some tiles are uniform and some are not
    keys = torch.randint(0, 3, (2, 2, n, 4), generator=g).float()
    keep = torch.rand(2, 2, n, generator=g) < keep_share
    sizing = PageSizing(split=split, max_tokens=max_tokens, min_tokens=min_tokens, mean_tokens=mean_tokens)
    lay, rc = _pages(keys, keep, sizing)
    levels = sizing.image_levels()
    top = PageSizing(split=1e9, max_tokens=max_tokens, min_tokens=min_tokens)  # never cuts: the top tiles
    lay_top, _ = _pages(keys, keep, top)
    for b in range(2):
        for h in range(2):
            pages = _page_tokens(lay, b, h)
            for kind in (IMAGE, TEXT):  # at most one page per mean_tokens kept tokens, or the uncut tiles
                n = int((lay.page_kind[b, h] == kind).sum())
                kept = int(lay.page_len[b, h][lay.page_kind[b, h] == kind].sum())
                n_top = int((lay_top.page_kind[b, h] == kind).sum())
                assert n <= max(-(-kept // mean_tokens), n_top)
            seen = sorted(t for toks in pages.values() for t in toks)
            assert seen == keep[b, h].nonzero().flatten().tolist()  # every kept token once
            for toks in pages.values():
                assert 1 <= len(toks) <= max_tokens
                if all(N_TEXT_HEAD <= t < N_TEXT_HEAD + GRID * GRID for t in toks):
                    rows = {int(rc[b, t, 1]) for t in toks}
                    cols = {int(rc[b, t, 2]) for t in toks}
                    # inside one aligned tile of one level
                    assert any(
                        len({r // th for r in rows}) == 1 and len({c // tw for c in cols}) == 1
                        for th, tw in levels
                    )
                    if split == 0.0 and mean_tokens == 1 and len(toks) > 1:  # only equal keys share a page
                        assert (
                            len({tuple(keys[b, h, t].tolist()) for t in toks}) == 1 or len(toks) <= min_tokens
                        )
                else:
                    assert not any(N_TEXT_HEAD <= t < N_TEXT_HEAD + GRID * GRID for t in toks)


def test_levels_nest_from_the_largest_tile():
    assert PageSizing(max_tokens=32, min_tokens=2).image_levels() == [(4, 8), (4, 4), (4, 2), (2, 2), (2, 1)]
    assert PageSizing(max_tokens=16, min_tokens=1).image_levels()[-1] == (1, 1)
    assert PageSizing(max_tokens=32, min_text_tokens=4).text_levels() == [32, 16, 8, 4]


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"retrieval": "quest", "page_split": 0.5}, ["page_split=0.5", "page_sizing='fixed'"]),
        ({"retrieval": "quest", "page_sizing": "adaptive"}, ["page_sizing='adaptive'", "fixed", "dynamic"]),
        ({"retrieval": "quest", "page_sizing": "dynamic", "image_tile": 2}, ["image_tile=2", "dynamic"]),
        (
            {"retrieval": "quest", "page_sizing": "dynamic", "max_page_tokens": 24},
            ["max_page_tokens", "power of two"],
        ),
        (
            {"retrieval": "quest", "page_sizing": "dynamic", "min_page_tokens": 16, "max_page_tokens": 8},
            ["min_page_tokens=16"],
        ),
        ({"retrieval": "quest", "page_sizing": "dynamic", "page_split": -1}, ["page_split", ">= 0"]),
        ({"page_sizing": "dynamic"}, ["page_sizing='dynamic'", "retrieval"]),
    ],
)
def test_bad_page_sizing_knobs_are_refused_by_name(kwargs, words):
    with pytest.raises(ConfigError) as err:
        OvalConfig(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_dynamic_pages_read_in_full_change_nothing_and_a_bytes_budget_is_kept(tiny_random_llava, llava_batch):
    model, processor = tiny_random_llava
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is it ?"}]}]
    prompt = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = llava_batch([prompt, prompt])
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    plain = model.generate(**inputs, **kw)
    for retrieval in ("quest", "oval"):
        cfg = OvalConfig(retrieval=retrieval, page_sizing="dynamic", sink_tokens=1, recent_tokens=0)
        wrapped = mm_oval.wrap(model, cfg)
        try:
            out = wrapped.generate(**inputs, **kw)
        finally:
            model = mm_oval.unwrap(wrapped)
        assert out.sequences.tolist() == plain.sequences.tolist()
        for a, b in zip(out.scores, plain.scores):
            assert torch.allclose(a, b, atol=1e-4)
    # random keys differ everywhere: a large split keeps pages whole, so summaries leave room for pages
    cfg = OvalConfig(
        retrieval="quest",
        page_sizing="dynamic",
        page_split=4.0,
        max_page_tokens=8,
        read_bytes_budget=0.6,
        sink_tokens=1,
        recent_tokens=0,
    )
    wrapped = mm_oval.wrap(model, cfg)
    try:
        wrapped.generate(**inputs, max_new_tokens=5, do_sample=False)
        br = get_stats(wrapped)["bytes_read"]
    finally:
        mm_oval.unwrap(wrapped)
    assert br["over_budget"] == 0
    assert br["total"]["image"]["selected"] > 0
    assert br["read_vs_dense"] <= 0.6 + 1e-9


def test_heads_sized_in_chunks_get_the_pages_they_get_alone():
    g = torch.Generator().manual_seed(1)
    n = N_TEXT_HEAD + GRID * GRID + N_TEXT_TAIL
    keys = torch.randint(0, 3, (2, 6, n, 4), generator=g).float()
    keep = torch.rand(2, 6, n, generator=g) < 0.8
    mod, _, rc, _ = _prompt(2)
    sizing = PageSizing(mean_tokens=4)
    whole, n_whole = dynamic_labels(keys, keep, mod, rc, sizing, head_chunk=6)
    chunked, n_chunked = dynamic_labels(keys, keep, mod, rc, sizing, head_chunk=4)
    assert n_whole == n_chunked and torch.equal(whole, chunked)


def test_the_smallest_dynamic_page_is_16_tokens_unless_the_largest_is_smaller():
    """Dynamic image pages default to 16-32 tokens (4x4 and 4x8 tiles: smaller pages lost accuracy at equal
    bytes on the 576-token benchmark); a smaller max_page_tokens alone brings the floor down with it, and
    an explicit min_page_tokens above it is still refused."""
    cfg = OvalConfig(retrieval="quest", page_sizing="dynamic")
    assert cfg.sizing.min_tokens == 16 and cfg.sizing.image_levels() == [(4, 8), (4, 4)]
    assert OvalConfig(retrieval="quest", page_sizing="dynamic", max_page_tokens=8).sizing.min_tokens == 8
    assert OvalConfig(retrieval="quest", page_sizing="dynamic", min_page_tokens=2).sizing.min_tokens == 2
    with pytest.raises(ConfigError, match="min_page_tokens=16 is above max_page_tokens=8"):
        OvalConfig(retrieval="quest", page_sizing="dynamic", min_page_tokens=16, max_page_tokens=8)
