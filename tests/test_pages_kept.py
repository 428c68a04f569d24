"""Pages over the kept tokens (page_sizing='kept'): each image's kept patches in Z-order, cut into runs
of image_tile^2, so the pages of an evicted cache are as full as the tiles of a whole one."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm_oval
from mm_oval.config import OvalConfig
from mm_oval.core import IMAGE, TEXT
from mm_oval.errors import ConfigError
from mm_oval.pages import kept_labels, layout_pages

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = ("src", "slot_page", "page_start", "page_len", "page_kind", "page_pinned")


def _prompt(sides=(8,), n_head=6, n_gap=3, n_tail=5, batch=1):
    """Text, then images (side x side patch grids) separated by text runs: modality, positions,
    image_rc, protected (the first token)."""
    mods, rcs = [TEXT] * n_head, [[-1, -1, -1]] * n_head
    for i, side in enumerate(sides):
        if i:
            mods += [TEXT] * n_gap
            rcs += [[-1, -1, -1]] * n_gap
        mods += [IMAGE] * side * side
        rcs += [[i, p // side, p % side] for p in range(side * side)]
    mods += [TEXT] * n_tail
    rcs += [[-1, -1, -1]] * n_tail
    n = len(mods)
    mod = torch.tensor(mods).expand(batch, n).clone()
    rc = torch.tensor(rcs).expand(batch, n, 3).clone()
    prot = torch.zeros(batch, n, dtype=torch.bool)
    prot[:, 0] = True
    return mod, torch.arange(n).expand(batch, n), rc, prot


def _layout(keep, prompt, tile, kept=True):
    mod, pos, rc, prot = prompt
    labels = kept_labels(keep, mod, rc, tile, 16) if kept else None
    return layout_pages(keep, mod, pos, rc, prot, tile, 16, labels=labels)


@pytest.mark.parametrize("tile, sides", [(2, (8,)), (4, (24,)), (4, (24, 8)), (2, (6, 4))])
def test_with_nothing_evicted_the_runs_are_the_fixed_tiles(tile, sides):
    prompt = _prompt(sides, batch=2)
    keep = torch.ones(2, 3, prompt[0].shape[1], dtype=torch.bool)
    fixed, runs = _layout(keep, prompt, tile, kept=False), _layout(keep, prompt, tile)
    for f in FIELDS:
        assert torch.equal(getattr(fixed, f), getattr(runs, f)), f


def _pages_of(lay, b, h):
    out: dict[int, list[int]] = {}
    for src, page in zip(lay.src[b, h].tolist(), lay.slot_page[b, h].tolist()):
        if src >= 0:
            out.setdefault(page, []).append(src)
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), share=st.floats(0.02, 0.9), tile=st.sampled_from([2, 4]))
def test_evicted_images_make_full_pages_of_one_image_each(seed, share, tile):
    prompt = _prompt((8, 12))
    mod, _, rc, _ = prompt
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(1, 3, mod.shape[1], generator=g) < share
    keep[..., 0] = True
    lay = _layout(keep, prompt, tile)
    run = tile * tile
    for h in range(3):
        pages = _pages_of(lay, 0, h)
        kinds = lay.page_kind[0, h]
        seen = sorted(i for toks in pages.values() for i in toks)
        assert seen == keep[0, h].nonzero().squeeze(1).tolist()  # every kept token, once
        short = {}
        for page, toks in pages.items():
            if int(kinds[page]) != IMAGE:
                assert all(int(mod[0, i]) == TEXT for i in toks)
                continue
            images = {int(rc[0, i, 0]) for i in toks}
            assert len(images) == 1 and all(int(mod[0, i]) == IMAGE for i in toks)
            assert len(toks) <= run
            if len(toks) < run:
                img = images.pop()
                short[img] = short.get(img, 0) + 1
        assert all(n == 1 for n in short.values())  # only an image's last run is short
        for img in (0, 1):
            kept_img = int((keep[0, h] & (rc[0, :, 0] == img)).sum())
            n_pages = sum(
                1
                for toks in pages.values()
                if int(mod[0, toks[0]]) == IMAGE and int(rc[0, toks[0], 0]) == img
            )
            assert n_pages == -(-kept_img // run)


def test_runs_follow_the_z_order_so_a_kept_block_becomes_tiles():
    """A head that kept one 8x8 corner of a 24x24 grid (and a stray patch) gets that block as four 4x4
    tiles, not as rows of the grid."""
    prompt = _prompt((24,), n_head=2, n_tail=2)
    mod, _, rc, _ = prompt
    r, c = rc[0, :, 1], rc[0, :, 2]
    block = (mod[0] == IMAGE) & (r >= 8) & (r < 16) & (c >= 16)
    keep = (block | (mod[0] == TEXT))[None, None].clone()
    lay = _layout(keep, prompt, 4)
    tiles = sorted(
        sorted((int(r[i]) // 4, int(c[i]) // 4) for i in toks)
        for toks in _pages_of(lay, 0, 0).values()
        if int(mod[0, toks[0]]) == IMAGE
    )
    assert [sorted(set(t)) for t in tiles] == [[(2, 4)], [(2, 5)], [(3, 4)], [(3, 5)]]


def test_kept_pages_are_refused_without_retrieval_or_with_dynamic_knobs():
    assert OvalConfig(retrieval="quest", page_sizing="kept", image_tile=4).max_page_len == 16
    with pytest.raises(ConfigError, match="page_sizing='kept'.*retrieval|retrieval.*page_sizing='kept'"):
        OvalConfig(page_sizing="kept")
    with pytest.raises(ConfigError, match="max_page_tokens=8 set with page_sizing='kept'"):
        OvalConfig(retrieval="quest", page_sizing="kept", max_page_tokens=8)


def test_kept_pages_after_eviction_read_in_full_change_nothing(tiny_random_llava, llava_batch):
    """Eviction, then retrieval over pages of kept tokens that reads every page: the eviction's answer."""
    model, processor = tiny_random_llava
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color is it ?"}]}]
    prompt = processor.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = llava_batch([prompt, prompt])
    kw = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    evict = dict(method="snapkv", budget=0.25, sink_tokens=1, recent_tokens=0)
    outs = []
    for cfg in (OvalConfig(**evict), OvalConfig(**evict, retrieval="quest", page_sizing="kept")):
        wrapped = mm_oval.wrap(model, cfg)
        try:
            outs.append(wrapped.generate(**inputs, **kw))
        finally:
            model = mm_oval.unwrap(wrapped)
    assert outs[0].sequences.tolist() == outs[1].sequences.tolist()
    for a, b in zip(outs[0].scores, outs[1].scores):
        assert torch.allclose(a, b, atol=1e-4)
