"""KVzip: its pre-pass scores equal the attention of the reconstruction computed directly (eager, the whole
sequence), chunk by chunk as kvpress normalises it; a hand-worked case where it keeps another token than
SnapKV and KeyDiff; exact budgets; padding never matters; the model is left as it was; both compress
settings; clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

import mm_oval
from mm_oval.cache import choose_kept, request_info
from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError
from mm_oval.policies.base import IMAGE, TEXT, PrefillContext, make_eviction
from mm_oval.policies.kvzip import KVzip, KVzipRequest, reconstruction_scores
from mm_oval.training.router import new_router
from mm_oval.wrapper import prefill, wrap_info

pytestmark = pytest.mark.usefixtures("one_thread")


def _images(n: int, seed: int = 3) -> list[Image.Image]:
    g = torch.Generator().manual_seed(seed)
    return [
        Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())
        for _ in range(n)
    ]


TEXTS = [
    "USER: <image>\nwhat color is the circle ? ASSISTANT:",
    "USER: <image>\nhow many ? ASSISTANT:",
]


@pytest.fixture(scope="module")
def inputs(tiny_random_llava):
    _, processor = tiny_random_llava
    return dict(processor(images=_images(2), text=TEXTS, return_tensors="pt", padding=True))


@pytest.fixture(scope="module")
def tok(tiny_random_llava_dir):
    return str(tiny_random_llava_dir)


def _eager_attentions(model, **kw) -> tuple[torch.Tensor, ...]:
    """Every layer's full softmax attention (eager) of the unwrapped model over one sequence."""
    cfg = model.model.language_model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        with torch.no_grad():
            return model(**kw, output_attentions=True).attentions
    finally:
        cfg._attn_implementation = old


def _max_over_rows(att: torch.Tensor, rows: slice, cols: slice, hkv: int) -> torch.Tensor:
    a = att[:, :, rows, cols]  # (1, Hq, R, n)
    return a.reshape(1, hkv, -1, *a.shape[2:]).amax(dim=(2, 3))


def test_prepass_equals_eager_attention_of_the_whole_reconstruction(tiny_random_llava, inputs, tok):
    """One chunk: [prompt, repeat prompt + template suffix, prompt] run eagerly; each prompt token's score is
    the largest attention any reconstruction row of the group's query heads gives it (sinks score 1)."""
    model, _ = tiny_random_llava
    pol = make_eviction("kvzip", tokenizer=tok)
    pol.bind(model)
    ids, pix = inputs["input_ids"][:1], inputs["pixel_values"][:1]
    state = pol.prepare_request(model, ids, torch.ones_like(ids), pix, chunk_size=7)
    assert isinstance(state, KVzipRequest) and state.chunks == 1
    repeat, _, suffix = pol._ids
    N = ids.shape[1]
    full = torch.cat([ids, torch.tensor([repeat + suffix]), ids], dim=1)
    att = _eager_attentions(
        model, input_ids=full, attention_mask=torch.ones_like(full), pixel_values=torch.cat([pix, pix])
    )
    hkv = model.config.text_config.num_key_value_heads
    for layer, a in enumerate(att):
        ref = _max_over_rows(a, slice(N, None), slice(0, N), hkv)
        ref[..., :4] = 1.0
        torch.testing.assert_close(state.scores[layer], ref, atol=2e-5, rtol=1e-4)
    assert (state.scores[0][..., 4:] < 1.0).all()  # probabilities, not a constant


def test_later_chunks_are_normalised_over_sinks_chunk_and_repeat_keys(tiny_random_llava, tok):
    """Several chunks (kvpress): chunk c is reconstructed after "Repeat the part ... starting with" + the last
    8 tokens of chunk c-1; its softmax covers the first n_sink tokens, the chunk and the repeat sequence."""
    model, processor = tiny_random_llava
    ids = processor.tokenizer(
        ["USER: what color is the circle ? the square is red and the circle is blue . ASSISTANT:"],
        return_tensors="pt",
    )["input_ids"]
    N, C = ids.shape[1], 7
    pol = make_eviction("kvzip", tokenizer=tok, context_chunk=C)
    pol.bind(model)
    state = pol.prepare_request(model, ids, None, None)
    assert state.chunks == math.ceil(N / C) >= 3
    repeat, cont, suffix = pol._ids
    hkv = model.config.text_config.num_key_value_heads
    ref = [torch.zeros(1, hkv, N) for _ in state.scores]
    for c in range(state.chunks):
        lo, hi = c * C, min(N, (c + 1) * C)
        prompt = repeat if c == 0 else cont + ids[0, max(0, lo - 8) : lo].tolist()
        seq = torch.cat([ids, torch.tensor([prompt + suffix]), ids[:, lo:hi]], dim=1)
        att = _eager_attentions(model, input_ids=seq, attention_mask=torch.ones_like(seq))
        allowed = torch.zeros(seq.shape[1], dtype=torch.bool)
        allowed[:4] = True
        allowed[lo:hi] = True
        allowed[N:] = True
        for layer, a in enumerate(att):
            p = a * allowed
            p = p / p.sum(-1, keepdim=True)  # the softmax restricted to the allowed keys
            ref[layer][..., lo:hi] = _max_over_rows(p, slice(N, None), slice(lo, hi), hkv)
    for layer, r in enumerate(ref):
        r[..., :4] = 1.0
        torch.testing.assert_close(state.scores[layer], r, atol=2e-5, rtol=1e-4)


def test_hand_worked_choice_differs_from_snapkv_and_keydiff():
    """Five prompt keys (D=2): k0=(1,0), k1=(0.5,0), k2=(0,1), k3=(-1,0) and the last token's k4=(0,0), which
    every method keeps (SnapKV's window, the recent token); which one of k0..k3 does each keep? The prompt's
    last query (0,5) looks at k2, so SnapKV (window 1) keeps k2; KeyDiff keeps k3, the one key against the
    mean direction (1,1)/sqrt 2; the reconstruction's query (5,0) looks at k0, so KVzip keeps k0, with
    probability e^5 / (e^5 + e^2.5 + e^0 + e^-5 + e^0 + e^0) (the repeat token's own key (0,0) is in the
    softmax)."""
    keys = torch.tensor([[1.0, 0.0], [0.5, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0]]).view(1, 1, 5, 2)
    ctx_q = torch.zeros(1, 1, 5, 2)
    ctx_q[0, 0, 4] = torch.tensor([0.0, 5.0])
    ctx = PrefillContext(
        layer_idx=0,
        keys=keys,
        values=torch.zeros_like(keys),
        queries=ctx_q,
        positions=torch.arange(5).view(1, 5),
        modality=torch.full((1, 5), TEXT, dtype=torch.int8),
        image_rc=torch.full((1, 5, 3), -1),
        scaling=1.0,
    )
    s = reconstruction_scores(
        torch.tensor([5.0, 0.0]).view(1, 1, 1, 2),
        torch.cat([keys, torch.zeros(1, 1, 1, 2)], dim=2),
        key_ok=torch.ones(1, 6, dtype=torch.bool),
        row_ok=torch.ones(1, 1, dtype=torch.bool),
        n_ctx=5,
        scaling=1.0,
    )
    z = math.exp(5) + math.exp(2.5) + 1 + math.exp(-5) + 1 + 1
    expected = torch.tensor([math.exp(5), math.exp(2.5), 1.0, math.exp(-5), 1.0]) / z
    torch.testing.assert_close(s.view(5), expected)
    ctx.request.prepared = KVzipRequest(scores=[s], chunks=1)
    chosen = {
        name: int(make_eviction(name, **opts).score(ctx).view(5)[:4].argmax())
        for name, opts in (("kvzip", {}), ("snapkv", {"window": 1, "kernel": 1}), ("keydiff", {}))
    }
    assert chosen == {"kvzip": 0, "snapkv": 2, "keydiff": 3}


@pytest.mark.parametrize("scope", ["image", "all"])
@pytest.mark.parametrize("head_budget", ["uniform", "shared"])
def test_budgets_are_exact_in_the_wrapped_model(tiny_random_llava, inputs, tok, scope, head_budget):
    model, _ = tiny_random_llava
    n_img = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    n_valid = inputs["attention_mask"].sum(-1)
    try:
        kept_by = {}
        for method in ("kvzip", "snapkv", "keydiff"):
            opts = {"tokenizer": tok} if method == "kvzip" else {}
            mm_oval.wrap(
                model, method=method, budget=0.25, eviction_scope=scope, head_budget=head_budget,
                sink_tokens=0, recent_tokens=0, method_options=opts,
            )  # fmt: skip
            cache = prefill(model, **inputs)
            kept_by[method] = [layer.store.p_src.clone() for layer in cache.layers]
            if method != "kvzip":
                continue
            assert isinstance(cache.request.prepared, KVzipRequest)
            H = cache.layers[0].keys.shape[1]
            for layer in cache.layers:
                kept = layer.slot_valid.sum(-1)  # (B, Hkv)
                want = (n_valid - n_img + 16).view(-1, 1)
                if head_budget == "shared":
                    assert (kept.sum(-1, keepdim=True) == H * want).all()
                else:
                    assert (kept == want).all()
                if scope == "image":
                    img = ((layer.slot_mod == IMAGE) & layer.slot_valid).sum(-1)
                    assert (img.sum(-1) == 16 * H).all() if head_budget == "shared" else img.eq(16).all()
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
            assert out.shape == (2, inputs["input_ids"].shape[1] + 2)
        for other in ("snapkv", "keydiff"):  # it keeps other tokens than both
            assert any(not torch.equal(a, b) for a, b in zip(kept_by["kvzip"], kept_by[other], strict=True))
    finally:
        mm_oval.unwrap(model)


def test_layerwise_false_ranks_every_layer_and_head_together(tiny_random_llava, inputs, tok):
    """KVzip's own allocation (`layerwise=False`, kvpress's default): per sample, the image tokens kept over
    every layer and KV head are exactly the top `layers x Hkv x k` of all their scores, so the layers keep
    different counts at the same total; the sinks stay in every head; generation runs on it. A budget
    wrapper over it is refused (it would have no per-layer budget to divide)."""
    model, _ = tiny_random_llava
    n_img = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    try:
        mm_oval.wrap(
            model, method="kvzip", budget=0.25, sink_tokens=2, recent_tokens=0,
            method_options={"tokenizer": tok, "layerwise": False},
        )  # fmt: skip
        cache = prefill(model, **inputs)
        scores = cache.request.prepared.scores  # per layer (B, Hkv, N)
        L, H = len(cache.layers), scores[0].shape[1]
        img = inputs["input_ids"] == model.config.image_token_id  # (B, N)
        for b in range(2):  # the second sample is left-padded: a slot's position counts its valid tokens
            first = int(inputs["attention_mask"][b].nonzero().min())
            kept = torch.zeros(L, H, img.shape[1], dtype=torch.bool)
            for li, layer in enumerate(cache.layers):
                pos = layer.slot_pos[b, :, : layer.prompt_slots]
                ok = layer.slot_valid[b, :, : layer.prompt_slots] & (pos >= 0)
                for h in range(H):
                    kept[li, h, first + pos[h][ok[h]]] = True
            joint = torch.stack([s[b] for s in scores])  # (L, H, N)
            mine = kept & img[b]
            want = L * H * math.ceil(n_img * 0.25)
            assert int(mine.sum()) == want
            top = joint.masked_fill(~img[b], float("-inf")).flatten().topk(want).indices
            assert torch.equal(mine.flatten().nonzero().flatten().sort().values, top.sort().values)
            per_layer = mine.sum((1, 2))
            assert len(set(per_layer.tolist())) > 1  # the layers keep different counts
            assert kept[:, :, first : first + 2].all()  # the sinks, in every head of every layer
        out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert out.shape == (2, inputs["input_ids"].shape[1] + 2)
    finally:
        mm_oval.unwrap(model)
    for wrapper in ("pyramidkv", "adakv"):
        with pytest.raises(ConfigError, match="layerwise=true"):
            make_eviction(wrapper, scorer="kvzip", layerwise=False)


def test_padding_never_matters(tiny_random_llava, inputs, tok):
    """Each sample of a left-padded batch scores as it does alone, whatever token fills its padding."""
    model, _ = tiny_random_llava
    pol = make_eviction("kvzip", tokenizer=tok, context_chunk=16)  # several chunks, differing per sample
    pol.bind(model)
    ids, am, pix = inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"]
    assert am[1].sum() < am[0].sum()  # the second sample is left-padded
    batch = pol.prepare_request(model, ids, am, pix)
    other_pad = ids.masked_fill(am == 0, 7)
    batch2 = pol.prepare_request(model, other_pad, am, pix)
    for b in range(2):
        v = am[b].bool()
        alone = pol.prepare_request(model, ids[b : b + 1, v], None, pix[b : b + 1])
        for layer in range(len(batch.scores)):
            torch.testing.assert_close(
                batch.scores[layer][b][:, v], alone.scores[layer][0], atol=1e-5, rtol=1e-4
            )
            torch.testing.assert_close(batch2.scores[layer][b], batch.scores[layer][b], atol=1e-5, rtol=1e-4)
            assert (batch.scores[layer][b][:, ~v] == 0).all()


def test_model_is_left_as_it_was_and_keeping_everything_equals_the_full_model(tiny_random_llava, inputs, tok):
    """A budget that keeps every token but still runs the method (a token count past the prompt): the
    pre-pass runs, and the answers are the plain model's; the pre-pass changes no weight, attention setting
    or hook, and mm-oval's own hooks do not see it (the retrieval's prompt embeddings are the prompt's)."""
    model, _ = tiny_random_llava
    lm = model.model.language_model
    ref = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        mm_oval.wrap(
            model, method="kvzip", budget=10_000, text_budget=10_000, retrieval="router",
            method_options={"tokenizer": tok}, retrieval_options={"router": new_router(model)},
        )  # fmt: skip
        attn = lm.config._attn_implementation
        hooks = [dict(m._forward_pre_hooks) | dict(m._forward_hooks) for m in model.modules()]
        cache = prefill(model, **inputs)
        assert isinstance(cache.request.prepared, KVzipRequest)
        assert cache.request.inputs_embeds.shape[1] == inputs["input_ids"].shape[1]
        assert lm.config._attn_implementation == attn
        assert hooks == [dict(m._forward_pre_hooks) | dict(m._forward_hooks) for m in model.modules()]
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert torch.equal(out, ref)
    finally:
        mm_oval.unwrap(model)
    assert lm.config._attn_implementation == "sdpa"
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_compress_image_reconstructs_the_prompt_head(tiny_random_llava, inputs, tok):
    """`--compress image`: the context is the head passed to prefill (template + image); the question comes
    after, on a copy of the compressed cache."""
    model, processor = tiny_random_llava
    ids, pix = inputs["input_ids"][:1], inputs["pixel_values"][:1]
    ends = int((ids[0] == model.config.image_token_id).nonzero().max()) + 1
    head = {"input_ids": ids[:, :ends], "attention_mask": torch.ones_like(ids[:, :ends]), "pixel_values": pix}
    try:
        mm_oval.wrap(
            model,
            method="kvzip",
            budget=0.25,
            sink_tokens=0,
            recent_tokens=0,
            method_options={"tokenizer": tok},
        )
        cache = prefill(model, **head)
        assert cache.request.prepared.scores[0].shape == (1, 2, ends)
        kept_img = ((cache.layers[0].slot_mod == IMAGE) & cache.layers[0].slot_valid).sum(-1)
        assert kept_img.eq(16).all()
        seq = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache=cache.copy(),
            max_new_tokens=2,
            do_sample=False,
        )
        assert seq.shape == (1, ids.shape[1] + 2)
    finally:
        mm_oval.unwrap(model)


def test_tokenizer_comes_from_the_model_folder_or_a_clear_error(tiny_random_llava, tiny_random_llava_dir):
    from transformers import LlavaForConditionalGeneration

    model, _ = tiny_random_llava
    with pytest.raises(ConfigError, match="tokenizer="):
        mm_oval.wrap(model, method="kvzip", budget=0.25)  # built in memory: no folder to read it from
    with pytest.raises(ConfigError, match="no tokenizer could be loaded"):
        mm_oval.wrap(model, method="kvzip", budget=0.25, method_options={"tokenizer": "/nonexistent/kvzip"})
    assert not mm_oval.is_wrapped(model)
    loaded = LlavaForConditionalGeneration.from_pretrained(tiny_random_llava_dir)
    mm_oval.wrap(loaded, method="kvzip", budget=0.25)
    assert wrap_info(loaded).eviction._ids is not None
    mm_oval.unwrap(loaded)


def test_options_from_a_spec_and_bad_options():
    cfg = OvalConfig.from_spec("kvzip:context_chunk=64,n_sink=2,chunk_size=32", budget=0.25)
    assert cfg.method_options == {"context_chunk": 64, "n_sink": 2} and cfg.chunk_size == 32
    pol = make_eviction(cfg.method, **cfg.method_options)
    assert isinstance(pol, KVzip) and pol.context_chunk == 64 and KVzip.comparable_across_heads
    for bad in (
        {"context_chunk": 0},
        {"n_sink": -1},
        {"repeat_prompt": ""},
        {"tokenizer": 3},
        {"layerwise": "no"},
    ):
        with pytest.raises(ConfigError, match="kvzip"):
            make_eviction("kvzip", **bad)


def test_score_without_its_prepass_is_a_clear_error():
    """A cache prefilled by a plain forward (not generate or prefill) has no reconstruction scores."""
    info = request_info(torch.arange(6).view(1, 6), None, 99, 4, 0, 0)
    ctx = PrefillContext(
        layer_idx=0, keys=torch.zeros(1, 2, 6, 4), values=torch.zeros(1, 2, 6, 4), queries=None,
        positions=info.positions, modality=info.modality, image_rc=info.image_rc, scaling=0.5,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="mm_oval.wrapper.prefill"):
        make_eviction("kvzip").score(ctx)
    ctx.request.prepared = KVzipRequest(scores=[torch.rand(1, 2, 6)], chunks=1)
    keep = choose_kept(make_eviction("kvzip").score(ctx), info, OvalConfig(method="kvzip", text_budget=2))
    assert keep.sum(-1).eq(2).all()
