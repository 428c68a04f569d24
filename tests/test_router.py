"""The hybrid page router as a network: shapes and masking, locality, saving/loading against the right
model only, the focal distillation loss, and that training learns a content-matching routing rule."""

import math

import pytest
import torch

from mm_oval.errors import ConfigError, DataError, ModelError
from mm_oval.policies.base import IMAGE, TEXT
from mm_oval.policies.router import (
    HybridRouter,
    RouterConfig,
    load_router,
    model_signature,
    pool_page_content,
    save_router,
)
from mm_oval.training.router import (
    RouterSample,
    TrainOptions,
    evaluate_capture,
    focal_loss,
    new_router,
    pca_page_init,
    train_router,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _router(**kw):
    return HybridRouter(RouterConfig(hidden_size=32, num_layers=3, num_kv_heads=2, route_dim=16, **kw))


def test_logits_mask_invalid_pages_and_decay_with_page_distance():
    torch.manual_seed(0)
    r = _router()
    emb = torch.zeros(1, 2, 5, 16)  # identical pages: only locality separates them
    kind = torch.full((1, 2, 5), IMAGE, dtype=torch.int8)
    valid = torch.tensor([True, True, True, True, False]).expand(1, 2, 5)
    logits = r(torch.randn(1, 32), emb, kind, valid, layer_idx=1)
    assert logits.shape == (1, 2, 5)
    assert torch.isinf(logits[..., 4]).all()
    # exp(-d/32) decay from the newest valid page (index 3)
    assert torch.allclose(
        logits[..., :4] - logits[..., 3:4], -torch.tensor([3.0, 2.0, 1.0, 0.0]) / 32, atol=1e-5
    )


def test_each_layer_and_head_gets_its_own_routing_vector_and_lora_starts_at_zero():
    torch.manual_seed(1)
    r = _router()
    h = torch.randn(2, 32)
    emb = torch.randn(2, 2, 6, 16)
    img = torch.ones(2, 2, 6, dtype=torch.bool)
    u0 = r.routing_vectors(h, emb, img, 0)
    u2 = r.routing_vectors(h, emb, img, 2)
    assert u0.shape == (2, 2, 16)
    assert not torch.allclose(u0, u2)
    x = torch.randn(3, r.config.mlp_hidden)
    assert torch.allclose(r.out(x), r.out.base(x))  # B = 0: LoRA adds nothing before training


def test_the_per_layer_rows_and_the_folded_cross_attention_give_the_full_computation():
    """At decode the router computes only its layer's rows of the output layer, folds the cross-attention's
    page keys and values into its query and pooled embedding (no per-page keys or values are kept), and
    takes the step's text state made once: the same vectors as the whole network, with a page left out."""
    torch.manual_seed(2)
    r = _router()
    with torch.no_grad():
        r.out.lora_b.normal_()  # a trained LoRA
    h = torch.randn(2, 32)
    emb = torch.randn(2, 2, 6, 16)
    img = torch.rand(2, 2, 6) > 0.3
    img[1, 0] = False  # a head without image pages: no fused term
    c = r.config
    with torch.no_grad():
        t = r.text_state(h)
        w = torch.softmax(
            ((r.xq(t)[:, None, None] * r.xk(emb)).sum(-1) / 4.0).masked_fill(~img, -torch.inf), -1
        )
        z = r.mlp(
            torch.cat(
                [t[:, None].expand(2, 2, 16), r.xo((w.nan_to_num(0)[..., None] * r.xv(emb)).sum(-2))], -1
            )
        )
        full = r.out(z).reshape(2, 2, c.num_layers, c.num_kv_heads, 16)
        for layer in range(c.num_layers):
            want = torch.stack([full[:, hh, layer, hh] for hh in range(2)], 1)
            torch.testing.assert_close(r.routing_vectors(h, emb, img, layer), want)
            torch.testing.assert_close(r.routing_vectors(h, emb, img, layer, t), want)


def test_pool_page_content_averages_the_page_tokens_only():
    embeds = torch.arange(12, dtype=torch.float).view(1, 6, 2)  # token i has embedding (2i, 2i+1)
    idx = torch.tensor([[[[0, 1, -1], [4, -1, -1], [-1, -1, -1]]]])  # (1, 1, 3 pages, 3 slots)
    content, has = pool_page_content(embeds, idx)
    assert content[0, 0, 0].tolist() == [1.0, 2.0]
    assert content[0, 0, 1].tolist() == [8.0, 9.0]
    assert has.tolist() == [[[True, True, False]]]


def _pool_widening_first(embeds, idx):
    """The page contents as the router first computed them: an fp32 copy of the prompt, then the gather."""
    b, n, hid = embeds.shape
    ok = (idx >= 0) & (idx < n)
    flat = idx.clamp(0, n - 1).reshape(b, -1)
    gathered = embeds.float().gather(1, flat.unsqueeze(-1).expand(-1, -1, hid)).view(*idx.shape, hid)
    w = ok.unsqueeze(-1).float()
    return (gathered * w).sum(-2) / w.sum(-2).clamp_min(1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pool_page_content_in_the_models_dtype_equals_widening_the_whole_prompt_first(dtype):
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(2, 40, 24, generator=g).to(dtype)
    idx = torch.randint(-1, 40, (2, 3, 7, 4), generator=g)
    idx[0, 0, 0] = -1  # a page without a prompt token
    content, has = pool_page_content(embeds, idx)
    assert content.dtype == torch.float32 and not bool(has[0, 0, 0])
    assert torch.equal(content, _pool_widening_first(embeds, idx))


def test_the_page_record_is_one_route_dim_vector_in_the_models_dtype_and_scores_as_fp32_would():
    """The router keeps per page and KV head only its page embedding, in the model's dtype: route_dim
    entries (64 bf16 = 128 bytes against 2 x 4 tokens x 128 x 2 bytes = 2 KiB of KV for a 2x2 image page of
    LLaVA-1.5-7B: 6.25%); scoring from it gives the fp32 record's logits within bf16 rounding."""
    from mm_oval.core import PageBatch, RequestState
    from mm_oval.policies.router import RouterRetrieval

    torch.manual_seed(4)
    r = _router()
    with torch.no_grad():
        r.out.lora_b.normal_()
    policy = RouterRetrieval(router=r)
    g = torch.Generator().manual_seed(4)
    embeds = torch.randn(1, 30, 32, generator=g)
    idx = torch.arange(24).view(1, 1, 6, 4).expand(1, 2, 6, 4).clone()
    kind = torch.full((1, 2, 6), IMAGE, dtype=torch.int8)
    summaries = {}
    for dtype in (torch.float32, torch.bfloat16):
        request = RequestState(inputs_embeds=embeds.to(dtype))
        keys = torch.zeros(1, 2, 6, 4, 8, dtype=dtype)
        batch = PageBatch(layer_idx=1, keys=keys, values=keys, mask=torch.ones(1, 2, 6, 4, dtype=torch.bool),
                          kind=kind, first_page=0, token_index=idx, request=request)  # fmt: skip
        summaries[dtype] = policy.summarize(batch)
        assert list(summaries[dtype]) == ["route_emb"]
        assert summaries[dtype]["route_emb"].shape == (1, 2, 6, 16)
        assert summaries[dtype]["route_emb"].dtype == dtype
    h = torch.randn(1, 32, generator=g)
    valid = torch.ones(1, 2, 6, dtype=torch.bool)
    with torch.no_grad():
        want = r(h, summaries[torch.float32]["route_emb"], kind, valid, 1)
        got = r(h, summaries[torch.bfloat16]["route_emb"], kind, valid, 1)
        exact = r(h, summaries[torch.float32]["route_emb"].bfloat16(), kind, valid, 1)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert not torch.equal(got, want)  # it is the bf16 record that was scored
    torch.testing.assert_close(got, exact, rtol=1e-2, atol=1e-2)


def test_focal_loss_prefers_the_teacher_pages_and_ignores_non_candidates():
    target = torch.tensor([[0.7, 0.3, 0.0, 5.0]])
    cand = torch.tensor([[True, True, True, False]])
    good = focal_loss(torch.tensor([[3.0, 2.0, -3.0, 0.0]]), target, cand)
    bad = focal_loss(torch.tensor([[-3.0, -2.0, 3.0, 0.0]]), target, cand)
    assert good < bad
    # the non-candidate's logit and teacher mass do not matter
    assert focal_loss(torch.tensor([[3.0, 2.0, -3.0, 99.0]]), target, cand) == pytest.approx(float(good))
    # with gamma = 0 it is the soft cross-entropy
    logits = torch.tensor([[0.5, 0.1, -0.2, 0.0]])
    ce = -(torch.tensor([0.7, 0.3, 0.0]) * torch.log_softmax(logits[0, :3], -1)).sum()
    assert focal_loss(logits, target, cand, gamma=0.0) == pytest.approx(float(ce), rel=1e-5)


def _content_task(n, seed, pages=12, hidden=32, layers=3, hkv=2):
    """Attention goes to the page whose content the hidden state points at: a router that reads content
    can learn it, a random pick holds 1/pages of the mass."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        content = torch.randn(pages, hidden, generator=g)
        target = torch.randint(0, pages, (6,), generator=g)
        hidden_state = content[target] + 0.3 * torch.randn(6, hidden, generator=g)
        mass = torch.full((6, layers, hkv, pages), 0.02)
        mass[torch.arange(6), :, :, target] = 1.0
        kind = torch.full((pages,), IMAGE, dtype=torch.int8)
        out.append(
            RouterSample(
                content, kind, torch.ones(pages, dtype=torch.bool), torch.arange(pages), hidden_state, mass
            )
        )
    return out


def test_distillation_learns_a_content_matching_rule():
    torch.manual_seed(0)
    train, val = _content_task(48, 1), _content_task(16, 2)
    r = _router()
    pca_page_init(r, train)
    before = evaluate_capture(r, val, read_budget=1 / 12)
    history = train_router(r, train, val, TrainOptions(epochs=25, lr=1e-2, batch=8, read_budget=1 / 12))
    after = history[-1]
    assert after["val_random"] == pytest.approx(1 / 12, abs=1e-6)
    assert after["val_router"] > max(0.5, before["router"] + 0.2)
    assert after["val_router"] <= after["val_oracle"] + 1e-6
    assert history[-1]["loss"] < history[0]["loss"]


def test_lora_only_training_changes_nothing_but_the_lora_factors():
    torch.manual_seed(0)
    r = _router()
    before = {k: v.clone() for k, v in r.state_dict().items()}
    train_router(r, _content_task(8, 3), None, TrainOptions(epochs=2, batch=4, lora_only=True))
    changed = {k for k, v in r.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"out.lora_a", "out.lora_b"}


def test_save_load_round_trip_and_a_router_for_another_model_is_refused(tmp_path, tiny_random_llava):
    from mm_oval.zoo.model import build_tiny_llava

    model, _ = tiny_random_llava
    r = new_router(model)
    save_router(r, tmp_path)
    back = load_router(tmp_path, model)
    h, emb = torch.randn(1, 128), torch.randn(1, 2, 4, 64)
    kind = torch.full((1, 2, 4), TEXT, dtype=torch.int8)
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    assert torch.allclose(back(h, emb, kind, valid, 3), r(h, emb, kind, valid, 3))
    assert back.config.model == model_signature(model)
    other, _ = build_tiny_llava(seed=5)  # same shapes, other weights
    with pytest.raises(ModelError, match="another model"):
        load_router(tmp_path, other)
    with pytest.raises(DataError, match="router"):
        load_router(tmp_path / "missing")


def test_bad_router_configs_raise_config_errors():
    with pytest.raises(ConfigError, match="route_dim"):
        HybridRouter(RouterConfig(hidden_size=8, num_layers=1, num_kv_heads=1, route_dim=0))
    with pytest.raises(ConfigError, match="locality_tau"):
        HybridRouter(RouterConfig(hidden_size=8, num_layers=1, num_kv_heads=1, locality_tau=-1.0))
    assert math.isclose(_router().log_temperature.exp().item(), 4.0, rel_tol=1e-6)


def test_bundled_router_holds_more_image_attention_than_a_random_pick():
    """Quality on the bundled trained tiny LLaVA: held-out prompts (a seed no training used)."""
    import mm_oval
    from mm_oval.policies.router import bundled_router_path
    from mm_oval.training.router import capture_router_data, zoo_prompts

    try:
        from mm_oval.zoo import bundled_model_path

        model_dir, router_dir = bundled_model_path(), bundled_router_path()
    except mm_oval.MmOvalError as e:
        pytest.skip(f"bundled model or router not present: {e}")
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    router = load_router(router_dir, model)  # also checks it was trained for this very model
    # on the pages it was trained on (2x2 tiles, scripts/rebuild_bundled.sh)
    samples = capture_router_data(model, processor, zoo_prompts(12, 7777), max_new_tokens=2, image_tile=2)
    got = evaluate_capture(router, samples, read_budget=0.25)
    assert got["router"] > got["random"] and got["router"] <= got["oracle"] + 1e-6
    # where the choice matters (heads focused on a few pages; measured 0.67 vs random 0.27 on 40 of 360)
    assert got["focused_rows"] >= 10
    assert got["focused_router"] > got["focused_random"] + 0.2
