"""The paged multimodal cache: budgets and their accounting (KV bytes == the budget's share), page
layout, decode-time page retrieval (exact attention over the pages read), the configuration."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.cache import choose_kept, request_info
from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError
from mm_oval.pages import layout_pages
from mm_oval.policies.base import IMAGE, PAD, TEXT, RetrievalPolicy
from mm_oval.stats import get_stats
from mm_oval.wrapper import prefill


def _inputs(processor, n=2):
    texts = [
        "USER: <image>\nwhat color is the circle ? ASSISTANT:",
        "USER: <image>\nhow many red objects ? ASSISTANT:",
    ]
    g = torch.Generator().manual_seed(0)
    imgs = [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(n)
    ]
    return processor(images=imgs, text=texts[:n], return_tensors="pt", padding=True)


@pytest.fixture
def model_and_processor(tiny_random_llava):
    model, processor = tiny_random_llava
    yield model, processor
    mm_oval.unwrap(model)


# ---- budgets ---------------------------------------------------------------------------------------


def _toy_info(B=2, N=40, n_img=16, pad=(0, 5), sink=2, recent=3):
    ids = torch.full((B, N), 7)
    mask = torch.ones(B, N, dtype=torch.long)
    for b in range(B):
        mask[b, : pad[b]] = 0
        ids[b, pad[b] + 4 : pad[b] + 4 + n_img] = 99
    return request_info(
        ids, mask, image_token_id=99, tokens_per_image=16, sink_tokens=sink, recent_tokens=recent
    )


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5, 5])
def test_choose_kept_keeps_each_modality_budget_per_sample_and_head(budget):
    info = _toy_info()
    scores = torch.randn(2, 3, 40)
    cfg = OvalConfig(method="random", budget=budget, text_budget=0.5, sink_tokens=2, recent_tokens=3)
    keep = choose_kept(scores, info, cfg)
    for b in range(2):
        n_img = int((info.modality[b] == IMAGE).sum())
        n_txt = int((info.modality[b] == TEXT).sum())
        want_img = budget if isinstance(budget, int) else math.ceil(budget * n_img)
        for h in range(3):
            k = keep[b, h]
            assert int((k & (info.modality[b] == IMAGE)).sum()) == want_img
            assert int((k & (info.modality[b] == TEXT)).sum()) == max(math.ceil(0.5 * n_txt), 5)
            assert not (k & (info.modality[b] == PAD)).any()
            assert k[info.protected[b]].all()  # sinks and the recent window are always kept
            # the rest is the top of the scores within the modality
            img = (info.modality[b] == IMAGE) & ~info.protected[b]
            kept_s, drop_s = scores[b, h][img & k], scores[b, h][img & ~k]
            if len(kept_s) and len(drop_s):
                assert kept_s.min() >= drop_s.max()


def test_protected_tokens_stay_when_the_method_scores_other_tokens_inf():
    """SnapKV scores its observation window +inf; at a tight text budget the window must not push the
    sinks and the recent window out (they rank above every score), and the window fills what is left."""
    info = _toy_info(sink=2, recent=3)
    scores = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(0))
    scores[..., 25:37] = float("inf")  # text tokens just before the recent window (both samples)
    for head_budget in ("uniform", "shared"):
        cfg = OvalConfig(
            method="snapkv",
            budget=0.5,
            text_budget=6,
            sink_tokens=2,
            recent_tokens=3,
            head_budget=head_budget,
        )
        keep = choose_kept(scores, info, cfg)
        txt = keep & (info.modality == TEXT).unsqueeze(1)
        assert (txt.sum((1, 2)) == 3 * 6).all()
        for b in range(2):
            assert keep[b][:, info.protected[b]].all()
            if head_budget == "uniform":  # one more per head: the window's first
                assert txt[b][:, 25].all() and not txt[b][:, 26:37].any()


@pytest.mark.parametrize("head_budget", ["uniform", "shared"])
def test_scores_of_minus_inf_or_nan_still_keep_the_exact_budget(head_budget):
    """A method may score tokens -inf (or NaN by mistake): they rank last, and the budget still counts
    exactly (text tokens before the image, also -inf once out of the image group, must not take its places)."""
    info = _toy_info(sink=2, recent=3)
    scores = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1))
    img = (info.modality == IMAGE).unsqueeze(1).expand(2, 3, 40)
    scores[img] = float("-inf")
    scores[:, :, 12] = float("nan")  # an image token of both samples
    scores[:, :, 10] = 1.0  # the one image token with a real score
    cfg = OvalConfig(
        method="snapkv", budget=8, text_budget=0.5, sink_tokens=2, recent_tokens=3, head_budget=head_budget
    )
    keep = choose_kept(scores, info, cfg)
    assert ((keep & img).sum((1, 2)) == 3 * 8).all()
    assert keep[:, :, 10].all()  # the scored token first (after the protected ones)


def test_scope_all_ranks_every_token_together_at_the_same_total_count():
    info = _toy_info(sink=0, recent=0)
    scores = torch.zeros(2, 1, 40)
    scores[..., :] = torch.where(info.modality == IMAGE, 1.0, 0.0).unsqueeze(1)  # images score higher
    per_mod = choose_kept(
        scores,
        info,
        OvalConfig(method="random", budget=0.25, text_budget=0.5, sink_tokens=0, recent_tokens=0),
    )
    blind = choose_kept(
        scores,
        info,
        OvalConfig(
            method="random",
            budget=0.25,
            text_budget=0.5,
            eviction_scope="all",
            sink_tokens=0,
            recent_tokens=0,
        ),
    )
    assert (per_mod.sum(-1) == blind.sum(-1)).all()
    # modality-blind: the higher-scoring image tokens take the whole budget
    # (sample 0: 4 image + 12 text = 16 tokens; sample 1: 4 image + 10 text = 14 tokens)
    assert (blind & (info.modality == IMAGE).unsqueeze(1)).sum(-1).tolist() == [[16], [14]]


def test_shared_head_budget_moves_memory_to_the_heads_that_score_higher():
    info = _toy_info(sink=2, recent=3)
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 40, generator=g)
    scores[:, 1] += 5.0  # head 1's tokens all score above the others'
    kw = dict(method="random", budget=0.25, text_budget=0.5, sink_tokens=2, recent_tokens=3)
    uniform = choose_kept(scores, info, OvalConfig(**kw))
    shared = choose_kept(scores, info, OvalConfig(**kw, head_budget="shared"))
    for m in (IMAGE, TEXT):
        is_m = (info.modality == m).unsqueeze(1)
        # the same memory per sample and modality, divided differently among the heads
        assert ((shared & is_m).sum((1, 2)) == (uniform & is_m).sum((1, 2))).all()
        assert ((shared & is_m)[:, 1].sum(-1) > (uniform & is_m)[:, 1].sum(-1)).all()
    for b in range(2):
        prot = info.protected[b]
        assert shared[b][:, prot].all()  # sinks and the recent window are kept in every head
        assert not (shared[b] & (info.modality[b] == PAD)).any()
        # what is kept is the joint top of the (head, token) scores of the modality
        img = ((info.modality[b] == IMAGE) & ~prot).expand(3, -1)
        kept_s, drop_s = scores[b][img & shared[b]], scores[b][img & ~shared[b]]
        assert kept_s.min() >= drop_s.max()
    # equal scores in every head: shared and uniform agree
    same = scores[:, :1].expand(2, 3, 40)
    assert torch.equal(choose_kept(same, info, OvalConfig(**kw, head_budget="shared")).sum(-1),
                       choose_kept(same, info, OvalConfig(**kw)).sum(-1))  # fmt: skip


def test_a_shared_head_budget_through_the_wrapped_model_keeps_the_uniform_memory(model_and_processor):
    model, processor = model_and_processor
    inputs = _inputs(processor)
    kept = {}
    for hb in ("uniform", "shared"):
        mm_oval.wrap(model, method="h2o", budget=0.25, head_budget=hb)
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert out.shape[1] == inputs["input_ids"].shape[1] + 3
        s = get_stats(model)
        kept[hb] = (s["kv_bytes_kept"], [row["image_tokens_kept"] for row in s["layers"]])
        mm_oval.unwrap(model)
    assert kept["shared"] == kept["uniform"]  # per layer, the heads' total is the uniform total


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5])
def test_kv_bytes_kept_are_the_budget_share_of_the_full_cache(model_and_processor, budget):
    model, processor = model_and_processor
    inputs = _inputs(processor)
    mm_oval.wrap(model, method="snapkv", budget=budget)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    s = get_stats(model)
    cfg = model.config.text_config
    per_token = (
        2 * (cfg.hidden_size // cfg.num_attention_heads) * 4 * cfg.num_key_value_heads
    )  # fp32 K+V, all heads
    info = request_info(inputs["input_ids"], inputs["attention_mask"], model.config.image_token_id, 64, 4, 16)
    n_img = (info.modality == IMAGE).sum(-1)
    n_txt = (info.modality == TEXT).sum(-1)
    share = torch.ceil(budget * n_img.double()).long()
    # the rule (docs/wrap.md): sinks and the recent window count inside the budget and are always kept
    prot_img = (info.protected & (info.modality == IMAGE)).sum(-1)
    kept_img = torch.maximum(share, prot_img)
    if budget >= 0.25:
        assert (share >= prot_img).all() and (kept_img == share).all()  # exactly the budget's share
    L = cfg.num_hidden_layers
    assert s["kv_bytes_kept"] == int((n_txt + kept_img).sum()) * per_token * L
    assert s["kv_bytes_full"] == int((n_txt + n_img).sum()) * per_token * L
    assert s["image_kv_fraction_kept"] == pytest.approx(int(kept_img.sum()) / int(n_img.sum()))
    assert all(row["image_tokens_kept"] == int(kept_img.sum()) for row in s["layers"])


# ---- pages -----------------------------------------------------------------------------------------


def test_pages_are_contiguous_runs_of_image_tiles_and_text_blocks():
    info = _toy_info(B=2, N=40, n_img=16, pad=(0, 5))
    torch.manual_seed(0)
    keep = (torch.rand(2, 2, 40) < 0.6) & (info.modality != PAD).unsqueeze(1)
    lay = layout_pages(
        keep, info.modality, info.positions, info.image_rc, info.protected, image_tile=2, text_page_size=4
    )
    for b in range(2):
        for h in range(2):
            src = lay.src[b, h][lay.src[b, h] >= 0]
            assert sorted(src.tolist()) == keep[b, h].nonzero().flatten().tolist()  # every kept token, once
            starts, lens = lay.page_start[b, h], lay.page_len[b, h]
            n_pages = int((lens > 0).sum())
            assert int(lens.sum()) == len(src)
            for j in range(n_pages):
                slots = range(int(starts[j]), int(starts[j] + lens[j]))
                toks = src[list(slots)]
                assert (lay.slot_page[b, h, list(slots)] == j).all()
                mods = info.modality[b, toks]
                assert (mods == mods[0]).all()
                assert lay.page_kind[b, h, j] == mods[0]
                if mods[0] == IMAGE:
                    rc = info.image_rc[b, toks]
                    assert len(toks) <= 4 and len({(int(r) // 2, int(c) // 2) for _, r, c in rc}) == 1
                else:
                    assert len(toks) <= 4
                pos = info.positions[b, toks]
                assert (pos[1:] > pos[:-1]).all()  # position order inside a page
                assert bool(lay.page_pinned[b, h, j]) == bool(info.protected[b, toks].any())
            # pages ordered by first position
            firsts = [int(info.positions[b, src[int(starts[j])]]) for j in range(n_pages)]
            assert firsts == sorted(firsts)


# ---- retrieval -------------------------------------------------------------------------------------


class FirstCandidateOnly(RetrievalPolicy):
    """Test policy: reads only the lowest-numbered candidate page of each head."""

    name = "first-candidate"

    def summarize(self, pages):
        return {"len": pages.lengths}

    def score_pages(self, ctx):
        return -torch.arange(ctx.page_len.shape[-1], dtype=torch.float32).expand_as(ctx.page_len)

    def select(self, ctx, read_budget):
        s = self.score_pages(ctx).masked_fill(~ctx.candidates, float("-inf"))
        return torch.nn.functional.one_hot(s.argmax(-1), s.shape[-1]).bool() & ctx.candidates


def test_decode_attention_reads_exactly_the_selected_pages(model_and_processor):
    model, processor = model_and_processor
    inputs = _inputs(processor)
    mm_oval.wrap(model, method="knorm", budget=0.5, sink_tokens=1, recent_tokens=2)
    cache = prefill(model, **inputs)
    cache.retrieval = FirstCandidateOnly()
    layer = cache.layers[1]
    layer._summarize(0, layer.prompt_pages)
    B, H, L, D = layer.keys.shape
    G = model.config.text_config.num_attention_heads // H
    q = torch.randn(B, H * G, 1, D)
    k_new, v_new = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    layer.update(k_new, v_new)
    out = layer.attend(q, scaling=D**-0.5)  # (B, 1, Hq, D)
    for b in range(B):
        for h in range(H):
            kinds, lens, pinned = layer.page_kind[b, h], layer.page_len[b, h], layer.page_pinned[b, h]
            cand = [j for j in range(len(lens)) if lens[j] > 0 and kinds[j] == IMAGE and not pinned[j]]
            read = [j for j in range(len(lens)) if lens[j] > 0 and j not in cand[1:]]
            slots = [
                s
                for j in read
                for s in range(int(layer.page_start[b, h, j]), int(layer.page_start[b, h, j] + lens[j]))
            ]
            assert slots[-1] == L  # the new token, in the open page
            keys, vals = layer.keys[b, h, slots], layer.values[b, h, slots]
            for g in range(G):
                a = torch.softmax(q[b, h * G + g, 0] @ keys.T * D**-0.5, -1)
                torch.testing.assert_close(out[b, 0, h * G + g], a @ vals, atol=1e-5, rtol=1e-5)
    assert cache.counters["pages_read"] == B * H and cache.counters["candidate_pages"] > B * H


def test_quest_reads_its_share_and_all_pages_change_nothing(model_and_processor):
    model, processor = model_and_processor
    inputs = _inputs(processor)
    plain = model.generate(
        **inputs, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    mm_oval.wrap(model, retrieval="quest", read_budget=1.0)
    out = model.generate(
        **inputs, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    assert out.sequences.tolist() == plain.sequences.tolist()
    mm_oval.wrap(model, retrieval="quest", read_budget=0.25, sink_tokens=0, recent_tokens=0)
    model.generate(**inputs, max_new_tokens=4, do_sample=False)
    # 16 image tiles of 2x2 per image and head, none pinned: 4 read per step
    assert get_stats(model)["page_read_fraction"] == pytest.approx(0.25)


def test_quest_scores_bound_the_true_logits():
    from mm_oval.policies.base import DecodeContext, PageBatch
    from mm_oval.policies.quest import Quest

    torch.manual_seed(0)
    B, H, G, P, T, D = 1, 2, 2, 5, 4, 8
    keys = torch.randn(B, H, P, T, D)
    mask = torch.ones(B, H, P, T, dtype=torch.bool)
    mask[0, 0, 1, 2:] = False
    pages = PageBatch(0, keys, keys, mask, torch.full((B, H, P), IMAGE, dtype=torch.int8), 0)
    summ = Quest().summarize(pages)
    q = torch.randn(B, H * G, 1, D)
    # Quest's per-page bound is >= every true logit of the page (for each query head)
    for h in range(H):
        for g in range(G):
            qq = q[0, h * G + g, 0]
            bound = torch.maximum(qq * summ["kmin"][0, h], qq * summ["kmax"][0, h]).sum(-1)
            true = (keys[0, h] @ qq).masked_fill(~mask[0, h], float("-inf")).amax(-1)
            assert (bound >= true - 1e-5).all()
    ctx = DecodeContext(
        0,
        q,
        summ,
        torch.zeros(B, H, P, dtype=torch.long),
        mask.sum(-1),
        pages.kind,
        torch.ones(B, H, P, dtype=torch.bool),
        D**-0.5,
    )
    s = Quest().score_pages(ctx)
    assert s.shape == (B, H, P)
    torch.testing.assert_close(s.exp().sum(-1), torch.ones(B, H))  # log of a mean of softmaxes
    chosen = Quest().select(ctx, 0.4)
    assert chosen.sum(-1).tolist() == [[2, 2]]


def test_decode_pages_close_and_get_summaries(model_and_processor):
    model, processor = model_and_processor
    inputs = _inputs(processor, 1)
    mm_oval.wrap(model, retrieval="quest", read_budget=0.5, read_scope="all", text_page_size=4)
    cache = prefill(model, **inputs)
    layer = cache.layers[0]
    p0 = layer.prompt_pages
    assert layer.summaries["kmin"].shape[2] == p0
    B, H, _, D = layer.keys.shape
    for _ in range(9):
        layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
    assert layer.summaries["kmin"].shape[2] == p0 + 2  # two full pages of 4 closed, one open
    assert layer.page_len[0, 0, p0:].tolist() == [4, 4, 1]
    assert layer.get_seq_length() == inputs["input_ids"].shape[1] + 9
    assert layer.slot_pos[0, 0, -1] == inputs["input_ids"].shape[1] + 8


# ---- configuration ---------------------------------------------------------------------------------


def test_from_spec_parses_method_options_and_config_fields():
    cfg = OvalConfig.from_spec(
        "snapkv:window=16,kernel=7,pooling=maxpool,eviction_scope=all,text_budget=0.5", budget=0.25
    )
    assert (
        cfg.method == "snapkv"
        and cfg.budget == 0.25
        and cfg.eviction_scope == "all"
        and cfg.text_budget == 0.5
    )
    assert cfg.method_options == {"window": 16, "kernel": 7, "pooling": "maxpool"}
    assert OvalConfig.from_spec("full").method == "full"
    assert OvalConfig.from_spec("tova:per_head=false", 64).method_options == {"per_head": False}
    assert OvalConfig.from_spec("full:retrieval=quest,read_budget=0.25").retrieval == "quest"
    with pytest.raises(ConfigError, match="key=value"):
        OvalConfig.from_spec("snapkv:window")
    with pytest.raises(ConfigError, match="budget=2.0 is out of range"):
        OvalConfig.from_spec("snapkv", budget=2.0)


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"budget": 0.0}, "out of range"),
        ({"text_budget": -3}, "out of range"),
        ({"budget": True}, "fraction"),
        ({"eviction_scope": "video"}, "eviction_scope"),
        ({"read_scope": "pages"}, "read_scope"),
        ({"head_budget": "per-layer"}, "head_budget"),
        ({"read_budget": 1.5}, "read_budget"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"image_tile": 0}, "image_tile"),
    ],
)
def test_config_validation(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        OvalConfig(**kw)


def test_unknown_retrieval_lists_the_known_ones(model_and_processor):
    model, _ = model_and_processor
    with pytest.raises(ConfigError, match="unknown retrieval method 'nope'; known methods: .*quest"):
        mm_oval.wrap(model, retrieval="nope")


@pytest.mark.parametrize("read_budget", [1.0, 0.3])
@pytest.mark.parametrize("sizing", [{}, {"page_sizing": "dynamic", "page_split": 0.5, "min_page_tokens": 1}])
def test_the_kernel_decode_path_equals_the_sdpa_path(model_and_processor, read_budget, sizing):
    """mm_oval.kernels.sparse_paged_decode (its torch reference on CPU) over the pages read gives what
    SDPA with the per-head slot mask gives, with fixed pages and with dynamic ones (1-32 tokens)."""
    model, processor = model_and_processor
    inputs = _inputs(processor)
    mm_oval.wrap(
        model,
        method="h2o",
        budget=0.5,
        retrieval="quest",
        read_budget=read_budget,
        text_page_size=4,
        **sizing,
    )
    cache = prefill(model, **inputs)
    for layer in cache.layers:
        B, H, _, D = layer.keys.shape
        for _ in range(5):  # one decode page closes on the way
            layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        q = torch.randn(B, 2 * H, 1, D)
        cache.kernels = False
        ref = layer.attend(q, D**-0.5)
        cache.kernels = True
        got = layer.attend(q, D**-0.5)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sparse_step_off_the_kernel_path_attends_over_the_gathered_slots(
    model_and_processor, monkeypatch, dtype
):
    """Off the kernel path, a decode step that reads a small share of the cache attends over the slots it
    reads gathered (what makes it cheaper than dense on CPU), and gets what SDPA over every slot with the
    per-head mask gets; a step that reads most of the cache (here: all of it) keeps the masked SDPA."""
    import mm_oval.cache.decode as cache_mod

    model, processor = model_and_processor
    inputs = _inputs(processor)
    # 2x2 tiles: with 4-token text pages, a step's gathered block is as wide as its longest page read
    mm_oval.wrap(model, retrieval="quest", read_budget=0.25, text_page_size=4, image_tile=2)
    cache = prefill(model, **inputs)
    cache.kernels = False
    gathered = []
    real = cache_mod.GatheredDecode.gathered
    monkeypatch.setattr(
        cache_mod.GatheredDecode, "gathered", lambda self, *a: gathered.append(a[3] * a[4]) or real(self, *a)
    )
    for layer in cache.layers:
        B, H, _, D = layer.keys.shape
        layer.store.k, layer.store.v = layer.store.k.to(dtype), layer.store.v.to(dtype)
        layer.store.set_views()
        for _ in range(5):
            layer.update(torch.randn(B, H, 1, D, dtype=dtype), torch.randn(B, H, 1, D, dtype=dtype))
        q = torch.randn(B, 2 * H, 1, D, dtype=dtype)
        n = len(gathered)
        monkeypatch.setattr(cache_mod, "GATHER_SHARE", 1.0)  # gather whatever the share read
        got = layer.attend(q, D**-0.5)
        assert len(gathered) == n + 1 and gathered[-1] < layer.keys.shape[2]  # gathered, fewer slots
        monkeypatch.setattr(cache_mod, "GATHER_SHARE", 0.0)
        want = layer.attend(q, D**-0.5)  # the masked SDPA over every slot
        assert len(gathered) == n + 1
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    monkeypatch.undo()
    mm_oval.wrap(model, retrieval="quest", read_budget=1.0, text_page_size=4, image_tile=2)
    cache = prefill(model, **inputs)
    cache.kernels = False
    monkeypatch.setattr(
        cache_mod.GatheredDecode, "gathered", lambda self, *a: gathered.append(a[3] * a[4]) or real(self, *a)
    )
    layer = cache.layers[0]
    B, H, _, D = layer.keys.shape
    n = len(gathered)
    layer.attend(torch.randn(B, 2 * H, 1, D), D**-0.5)
    assert len(gathered) == n  # reading every page: the masked SDPA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "setup",
    [
        {"method": "snapkv", "budget": 0.5},  # evicted slots: ragged image pages, heads of different lengths
        {"page_sizing": "dynamic", "page_split": 0.5, "min_page_tokens": 1},  # pages of 1..32 tokens
    ],
)
def test_the_gathered_pages_give_the_masked_attention_whatever_pages_are_read(
    model_and_processor, monkeypatch, dtype, setup
):
    """Off the kernel path, attention over the read pages copied as blocks equals SDPA over every slot with
    the per-head mask, for any pages read: a different number per KV head and sample (batch 2, padded
    prompts), image and text pages, ragged ones, decode pages after the prompt with a padded decode slot,
    and the last page of the storage read by a block that would run past its end."""
    import mm_oval.cache.decode as cache_mod

    model, processor = model_and_processor
    inputs = _inputs(processor)
    mm_oval.wrap(model, retrieval="quest", read_budget=0.25, text_page_size=4, **setup)
    cache = prefill(model, **inputs)
    cache.kernels = False
    gathered = []  # the block of each gathered step
    real = cache_mod.GatheredDecode.gathered
    monkeypatch.setattr(
        cache_mod.GatheredDecode, "gathered", lambda self, *a: gathered.append(a[4]) or real(self, *a)
    )
    g = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in cache.layers:
        B, H, _, D = layer.keys.shape
        layer.store.k, layer.store.v = layer.store.k.to(dtype), layer.store.v.to(dtype)
        layer.store.set_views()
        room = layer.store.cap - layer.keys.shape[2]
        for t in range(room):  # decode up to the storage's end; one decode slot of sample 1 is padding
            cache.step.new_valid = torch.tensor([[True], [t != 2]])
            layer.update(torch.randn(B, H, 1, D, dtype=dtype), torch.randn(B, H, 1, D, dtype=dtype))
        cache.step.new_valid = None
        assert layer.keys.shape[2] == layer.store.cap and not layer.slot_valid.all()
        assert torch.equal(
            layer.telemetry.head_resident, layer.slot_valid.sum(-1)
        )  # what a bytes budget divides
        last = int(
            (layer.page_len[-1, -1] > 0).nonzero().max()
        )  # the last head's last page: the storage's end
        assert int(layer.page_start[-1, -1, last] + layer.page_len[-1, -1, last]) == layer.store.cap
        for i in range(4):
            pages = torch.rand(layer.page_len.shape, generator=g) < torch.rand(B, H, 1, generator=g)
            pages[..., 0] = True  # every head reads a valid slot
            pages[-1, -1, last] = True
            pages &= layer.page_len > 0
            kinds = layer.page_kind[pages]
            assert (kinds == IMAGE).any() and (kinds == TEXT).any()
            monkeypatch.setattr(layer, "read_pages", lambda query, scaling, pages=pages: pages)
            q = torch.randn(B, 2 * H, 1, D, generator=g).to(dtype)
            monkeypatch.setattr(cache_mod, "GATHER_SHARE", float("inf"))  # gather whatever is read
            # the KV heads all in one SDPA call, or one head per call
            monkeypatch.setattr(cache_mod, "GATHER_CHUNK_BYTES", 1 if i % 2 else 1 << 30)
            gathered.clear()
            got = layer.attend(q, D**-0.5)
            assert len(gathered) == 1
            monkeypatch.setattr(cache_mod, "GATHER_SHARE", 0.0)
            want = layer.attend(q, D**-0.5)  # the masked SDPA over every slot
            assert len(gathered) == 1
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        if setup.get("page_sizing") == "dynamic":  # the block of the storage's last page starts before it
            assert int(layer.page_start[-1, -1, last]) + gathered[0] > layer.store.cap


def test_storage_grows_in_place_during_long_decodes(model_and_processor):
    """Decode writes into preallocated room that doubles when full; what attention reads is unchanged."""
    model, processor = model_and_processor
    inputs = _inputs(processor)
    mm_oval.wrap(model, method="knorm", budget=0.5, text_page_size=8)
    layer = prefill(model, **inputs).layers[2]
    B, H, L0, D = layer.keys.shape
    g = torch.Generator().manual_seed(0)
    new_k, new_v = torch.randn(B, H, 150, D, generator=g), torch.randn(B, H, 150, D, generator=g)
    before = layer.keys.clone()
    pages_before = layer.slot_page.clone()
    for t in range(150):
        layer.update(new_k[:, :, t : t + 1], new_v[:, :, t : t + 1])
    assert layer.keys.shape[2] == L0 + 150 and layer.store.cap >= L0 + 150
    # the prompt slots keep their pages (what retrieval's read mask and the bytes read go by)
    assert torch.equal(layer.slot_page[..., :L0], pages_before[..., :L0])
    torch.testing.assert_close(layer.keys[:, :, :L0], before)
    torch.testing.assert_close(layer.keys[:, :, L0:], new_k)
    torch.testing.assert_close(layer.values[:, :, L0:], new_v)
    assert layer.page_len[0, 0, layer.prompt_pages :].tolist() == [8] * 18 + [6]
    assert (layer.page_start[..., layer.prompt_pages + 3] == L0 + 24).all()
    n = inputs["attention_mask"].sum(-1)
    assert layer.slot_pos[:, 0, -1].tolist() == (n + 149).tolist()
    q = torch.randn(B, 2 * H, 1, D, generator=g)
    out = layer.attend(q, D**-0.5)
    for b in range(B):
        for h in range(H):
            keep = layer.slot_valid[b, h]
            k, v = layer.keys[b, h, keep], layer.values[b, h, keep]
            for gq in range(2):
                a = torch.softmax(q[b, h * 2 + gq, 0] @ k.T * D**-0.5, -1)
                torch.testing.assert_close(out[b, 0, h * 2 + gq], a @ v, atol=1e-5, rtol=1e-5)


def test_bytes_read_counted_per_page_equal_those_counted_per_slot(model_and_processor):
    """A step's bytes read are counted from the pages read (per prompt page, its valid slots) rather than
    by a pass over every slot: the same counts, image and text, for any pages read, with evicted and padded
    slots, after decode tokens closed a page."""
    model, processor = model_and_processor
    inputs = _inputs(processor)
    mm_oval.wrap(model, method="snapkv", budget=0.5, retrieval="quest", read_budget=0.5, text_page_size=4)
    cache = prefill(model, **inputs)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        B, H, _, D = layer.keys.shape
        for _ in range(6):
            layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))
        assert not bool(layer.slot_valid.all())  # padding / eviction left empty slots
        for _ in range(3):
            pages = torch.rand(layer.page_len.shape, generator=g) < 0.5
            read = layer.slot_valid & pages.gather(-1, layer.slot_page.clamp(min=0))
            by_slot = layer.telemetry.by_modality(layer.store, read)
            assert torch.equal(layer.telemetry.pages_by_modality(layer.store, pages), by_slot)


def test_a_copy_of_a_cache_does_not_copy_the_decode_scratch_buffer(model_and_processor):
    """cache.copy() (one compressed image, several questions) leaves the gathered-decode buffer behind: it
    holds nothing past a step, and the copy decodes as the original does."""
    model, processor = model_and_processor
    mm_oval.wrap(model, retrieval="quest", read_budget=0.25, text_page_size=4)
    cache = prefill(model, **_inputs(processor))
    cache.kernels = False
    layer = cache.layers[0]
    B, H, _, D = layer.keys.shape
    q = torch.randn(B, 2 * H, 1, D)
    cache.scratch(16, layer.keys.dtype, layer.keys.device)
    twin = cache.copy()
    assert cache._scratch is not None and twin._scratch is None
    torch.testing.assert_close(twin.layers[0].attend(q, D**-0.5), layer.attend(q, D**-0.5))


def test_prefill_then_generate_on_a_left_padded_batch_equals_one_generate(model_and_processor, llava_batch):
    """`prefill` (a prompt's head, e.g. the image) then `generate` over the whole prompt with a copy of that
    cache gives what one `generate` gives, for the left-padded sample too: the prefill places each sample's
    tokens at generate's positions (its count of valid tokens), not at their slots."""
    model, _ = model_and_processor
    texts = [
        "USER: <image>\nwhat color is the circle ? ASSISTANT:",
        "USER: <image>\nhow many red objects are there ? ASSISTANT:",
    ]
    inputs = llava_batch(texts, seed=3)
    assert inputs["attention_mask"][0, 0] == 0  # the shorter prompt is padded on the left
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    head = dict(inputs, input_ids=ids[:, :-4], attention_mask=mask[:, :-4])
    mm_oval.wrap(model, method="full")
    kw = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    whole = model.generate(**inputs, **kw)
    split = model.generate(input_ids=ids, attention_mask=mask, cache=prefill(model, **head).copy(), **kw)
    assert torch.equal(split.sequences, whole.sequences)
    for a, b in zip(split.scores, whole.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
