"""The eviction baselines: each keeps what its paper says it keeps; chunked attention rows equal the full
softmax; every method runs inside the wrapped tiny LLaVA at its budget."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.policies.base import (
    EVICTION_REGISTRY,
    IMAGE,
    PAD,
    TEXT,
    PrefillContext,
    RequestState,
    make_eviction,
)
from mm_oval.policies.heuristics import attention_rows, column_sums
from mm_oval.stats import get_stats
from mm_oval.wrapper import prefill

BASELINES = ["random", "streamingllm", "knorm", "keydiff", "h2o", "tova", "snapkv", "fastv"]


def _ctx(B=2, Hkv=2, G=2, N=23, D=8, pad=(0, 4), seed=0, chunk=5) -> PrefillContext:
    g = torch.Generator().manual_seed(seed)
    modality = torch.full((B, N), TEXT, dtype=torch.int8)
    modality[:, 6:14] = IMAGE
    positions = torch.arange(N).repeat(B, 1)
    for b, p in enumerate(pad):
        modality[b, :p] = PAD
        positions[b] = torch.arange(N) - p
        positions[b, :p] = -1
    return PrefillContext(
        layer_idx=0,
        keys=torch.randn(B, Hkv, N, D, generator=g),
        values=torch.randn(B, Hkv, N, D, generator=g),
        queries=torch.randn(B, Hkv * G, N, D, generator=g),
        positions=positions,
        modality=modality,
        image_rc=torch.full((B, N, 3), -1),
        scaling=D**-0.5,
        chunk_size=chunk,
    )


def _full_attention(ctx: PrefillContext) -> torch.Tensor:
    """The naive (B, Hq, N, N) attention matrix, causal, no padding keys."""
    G = ctx.num_kv_groups
    k = ctx.keys.repeat_interleave(G, 1)
    logits = ctx.queries @ k.transpose(-1, -2) * ctx.scaling
    N = k.shape[2]
    allowed = torch.ones(N, N, dtype=torch.bool).tril() & ctx.valid[:, None, None, :]
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)


def test_chunked_attention_rows_and_column_sums_equal_the_full_matrix():
    ctx = _ctx(chunk=4)
    full = _full_attention(ctx)
    rows = torch.tensor([3, 10, 22])
    torch.testing.assert_close(attention_rows(ctx, rows), full[:, :, rows], atol=1e-5, rtol=1e-5)
    want = (full * ctx.valid[:, None, :, None]).sum(2)  # padding query rows do not vote
    torch.testing.assert_close(column_sums(ctx), want, atol=1e-5, rtol=1e-5)


def test_attention_free_baselines_rank_as_published():
    ctx = _ctx()
    kn = make_eviction("knorm").score(ctx)
    assert (kn.argmax(-1) == ctx.keys.norm(dim=-1).argmin(-1)).all()  # smallest key norm first
    sl = make_eviction("streamingllm").score(ctx)
    assert (sl.argmax(-1) == ctx.keys.shape[2] - 1).all()  # most recent first
    kd = make_eviction("keydiff").score(ctx)
    k1 = torch.nn.functional.normalize(
        ctx.keys[1, 0, 4:], dim=-1
    )  # sample 1: 4 padding tokens, not in the anchor
    anchor = torch.nn.functional.normalize(k1.mean(0), dim=0)
    torch.testing.assert_close(kd[1, 0, 4:], -(k1 @ anchor))
    r1, r2 = make_eviction("random", seed=1).score(ctx), make_eviction("random", seed=1).score(ctx)
    assert torch.equal(r1, r2) and not torch.equal(r1, make_eviction("random", seed=2).score(ctx))


def test_attention_based_baselines_use_the_rows_they_publish():
    ctx = _ctx()
    full = _full_attention(ctx)
    B, Hq, N, _ = full.shape
    grouped = lambda x: x.view(B, 2, 2, N).mean(2)  # noqa: E731
    torch.testing.assert_close(
        make_eviction("tova").score(ctx), grouped(full[:, :, -1]), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        make_eviction("h2o").score(ctx),
        grouped((full * ctx.valid[:, None, :, None]).sum(2)),
        atol=1e-5,
        rtol=1e-5,
    )
    tova_shared = make_eviction("tova", per_head=False).score(ctx)
    assert torch.equal(tova_shared[:, 0], tova_shared[:, 1])
    # SnapKV: window votes pooled with avg_pool1d(kernel 3); the window itself is kept (score inf)
    s = make_eviction("snapkv", window=4, kernel=3).score(ctx)
    votes = grouped(full[:, :, -4:].sum(2))
    pooled = torch.nn.functional.avg_pool1d(votes.reshape(-1, 1, N), 3, 1, 1, count_include_pad=False).view(
        B, 2, N
    )
    assert torch.isinf(s[..., -4:]).all()
    torch.testing.assert_close(s[..., :-4], pooled[..., :-4], atol=1e-5, rtol=1e-5)


def test_fastv_ranks_image_tokens_once_at_its_layer_and_drops_them_above():
    fv = make_eviction("fastv", layer=1)
    request = RequestState()  # one request: FastV's ranking passes from its layer to the later ones
    scores = []
    for layer in range(3):
        ctx = _ctx(seed=layer)
        ctx.layer_idx, ctx.request = layer, request
        scores.append(fv.score(ctx))
    assert [fv.keep_layer_unchanged(i) for i in range(3)] == [True, True, False]
    ctx1 = _ctx(seed=1)
    want = _full_attention(ctx1)[:, :, -1].mean(1).masked_fill(ctx1.modality != IMAGE, 0.0)
    torch.testing.assert_close(scores[2][:, 0], want, atol=1e-5, rtol=1e-5)  # layer 1's ranking, at layer 2
    assert torch.equal(scores[2][:, 0], scores[2][:, 1])  # every KV head drops the same tokens


def test_fastv_layer_is_checked_against_the_model_it_is_wrapped_onto(tiny_random_llava):
    """Layers up to `layer` keep every token: on a model that has no layer above it, FastV would evict
    nothing and report its budget; wrap (and Chat) refuse it and say which layers fit."""
    from mm_oval.chat import Chat
    from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

    shallow, processor = build_tiny_llava(seed=0, sizes=TinyLlavaSizes(text_layers=3))
    with pytest.raises(mm_oval.ConfigError, match=r"layer=2 on a model of 3 layers evicts nothing.*0\.\.1"):
        mm_oval.wrap(shallow, method="fastv", budget=0.25)
    assert not mm_oval.is_wrapped(shallow)
    with pytest.raises(mm_oval.ConfigError, match="evicts nothing"):
        Chat(shallow, processor, Image.new("RGB", (128, 128)), method="fastv", budget=0.25)
    mm_oval.unwrap(mm_oval.wrap(shallow, method="fastv", budget=0.25, method_options={"layer": 1}))
    model, _ = tiny_random_llava  # 4 layers: layer 2 (the default) fits, layer 3 does not
    mm_oval.unwrap(mm_oval.wrap(model, method="fastv", budget=0.25))
    with pytest.raises(mm_oval.ConfigError, match="layer=3 on a model of 4 layers"):
        mm_oval.wrap(model, method="fastv", budget=0.25, method_options={"layer": 3})
    with pytest.raises(mm_oval.ConfigError, match="int >= 0"):
        make_eviction("fastv", layer=-1)


def test_snapkv_rejects_bad_options():
    with pytest.raises(mm_oval.ConfigError, match="kernel an odd int"):
        make_eviction("snapkv", kernel=4)
    with pytest.raises(mm_oval.ConfigError, match="bad options"):
        make_eviction("knorm", window=3)


def test_every_baseline_is_registered():
    make_eviction("random")
    assert set(BASELINES) <= set(EVICTION_REGISTRY)


@pytest.fixture(scope="module")
def inputs(llava_batch):
    texts = [
        "USER: <image>\nwhat color is the circle ? ASSISTANT:",
        "USER: <image>\nhow many objects ? ASSISTANT:",
    ]
    return llava_batch(texts, seed=3)


@pytest.mark.parametrize("method", BASELINES)
@pytest.mark.parametrize("scope", ["image", "all"])
def test_each_baseline_runs_in_the_wrapped_model_at_its_budget(tiny_random_llava, inputs, method, scope):
    model, _ = tiny_random_llava
    try:
        mm_oval.wrap(model, method=method, budget=0.25, eviction_scope=scope, sink_tokens=0, recent_tokens=0)
        cache = prefill(model, **inputs)
        n_img = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
        n_valid = inputs["attention_mask"].sum(-1)
        for layer in cache.layers:
            kept = layer.slot_valid.sum(-1)  # (B, Hkv)
            if method == "fastv" and layer.layer_idx <= 2:
                assert (kept == n_valid.view(-1, 1)).all()
                continue
            assert (kept == (n_valid - n_img + 16).view(-1, 1)).all()  # 25% of 64 image tokens, same total
            if scope == "image":
                assert ((layer.slot_mod == IMAGE) & layer.slot_valid).sum(-1).eq(16).all()
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert out.shape == (2, inputs["input_ids"].shape[1] + 3)
        assert get_stats(model)["method"] == method
    finally:
        mm_oval.unwrap(model)
