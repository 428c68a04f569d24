"""mm_oval.wrap on tiny random LLaVA-NeXT, LLaVA-OneVision and Qwen2.5-VL models (built from their configs,
nothing downloaded), with the guarantees LLaVA-1.5 has: at budget 1.0 the same greedy tokens as the plain
model (a batch of two with left padding, two images of different sizes in one prompt); at 0.25 a quarter of
each sample's image tokens per KV head; pages that are 2-D tiles of one grid; retrieval and the chat's
multi-turn path; Qwen2.5-VL's M-RoPE positions kept and continued as the model continues them."""

from __future__ import annotations

import pytest
import torch

import mm_oval
from mm_oval.chat import Chat
from mm_oval.errors import ConfigError
from mm_oval.policies.base import IMAGE, budget_count
from mm_oval.registry import EVICTION_REGISTRY, load_builtin_policies
from mm_oval.stats import get_stats
from mm_oval.wrapper import prefill
from mm_oval.zoo.family import BUILDERS, mixed_batch, random_image

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request):
    model, processor = BUILDERS[request.param]()
    yield request.param, model, processor
    mm_oval.unwrap(model)


def _greedy(model, inputs, n=6):
    return model.generate(
        **inputs, max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True
    )


@pytest.mark.parametrize("cfg", [{}, {"method": "snapkv", "budget": 1.0}])
def test_nothing_evicted_generates_exactly_what_the_plain_model_does(family, cfg):
    name, model, processor = family
    inputs = mixed_batch(processor)
    assert (inputs["attention_mask"] == 0).any(), "the batch must have left padding"
    mm_oval.unwrap(model)
    plain = _greedy(model, inputs)
    mm_oval.wrap(model, **cfg)
    out = _greedy(model, inputs)
    assert out.sequences.tolist() == plain.sequences.tolist()
    for a, b in zip(out.scores, plain.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = get_stats(model)
    assert stats["kv_fraction_kept"] == 1.0 and stats["decode_steps"] == 5


def test_a_quarter_of_each_samples_image_tokens_per_head(family):
    name, model, processor = family
    inputs = mixed_batch(processor)
    mm_oval.wrap(model, method="knorm", budget=0.25, recent_tokens=2)
    cache = prefill(model, **inputs)
    n_img = (cache.info.modality == IMAGE).sum(-1)  # (B,) image tokens of each sample, newlines excluded
    want = budget_count(0.25, n_img)
    for layer in cache.layers:
        kept = (layer.slot_mod == IMAGE).sum(-1)  # (B, Hkv)
        assert torch.equal(kept, want.view(-1, 1).expand_as(kept))
    stats = get_stats(model)
    assert stats["image_kv_fraction_kept"] == pytest.approx(float(want.sum() / n_img.sum()))
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_image_pages_are_tiles_of_one_grid(family):
    name, model, processor = family
    inputs = mixed_batch(processor)
    mm_oval.wrap(model, method="knorm", budget=0.5, image_tile=2)
    cache = prefill(model, **inputs)
    layer = cache.layers[1]
    rc, mod = layer.slot_rc, layer.slot_mod
    B, H, _ = mod.shape
    n_grids = [len(g) for g in cache.geometry.grids]
    for b in range(B):
        for h in range(H):
            seen = set()
            for p in range(int((layer.page_len[b, h] > 0).sum())):
                s, n = int(layer.page_start[b, h, p]), int(layer.page_len[b, h, p])
                if int(layer.page_kind[b, h, p]) != IMAGE:
                    continue
                tok = rc[b, h, s : s + n]
                assert (mod[b, h, s : s + n] == IMAGE).all()
                assert tok[:, 0].unique().numel() == 1  # one grid per page
                tile = {(int(r) // 2, int(c) // 2) for r, c in tok[:, 1:].tolist()}
                assert len(tile) == 1  # one 2 x 2 tile
                seen.add(int(tok[0, 0]))
            assert seen == set(range(n_grids[b]))  # every grid of the sample keeps some tokens


def test_retrieval_reads_fewer_pages_and_runs_to_the_end(family):
    name, model, processor = family
    inputs = mixed_batch(processor)
    mm_oval.wrap(model, method="full", retrieval="oval", read_budget=0.25, image_tile=2)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    stats = get_stats(model)
    assert 0 < stats["page_read_fraction"] < 1


def test_chat_multi_turn(family):
    name, model, processor = family
    mm_oval.unwrap(model)
    chat = Chat(
        model, processor, image=random_image(48, 80, 5), method="snapkv", budget=0.5, max_new_tokens=3
    )
    first = chat.ask("what color is the circle ?")
    second = chat.ask("what shape is the blue object ?")
    assert isinstance(first, str) and isinstance(second, str)
    assert all(1 <= t.new_tokens <= 3 for t in chat.turns)
    stats = chat.stats()
    assert stats["turns"] == 2 and stats["image_kv_fraction_kept"] == pytest.approx(0.5, abs=0.1)
    # the second turn continues the first one's cache: the prompt is not prefilled again
    assert chat.turns[1].prompt_tokens < chat.turns[0].prompt_tokens


def test_qwen_m_rope_positions_are_the_models_own_in_prefill_and_decode():
    model, processor = BUILDERS["qwen2_5_vl"]()
    inputs = mixed_batch(processor)
    seen = []
    lm = model.model.language_model
    hook = lm.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["position_ids"].clone()), with_kwargs=True
    )
    mm_oval.wrap(model, method="knorm", budget=0.25, recent_tokens=2)
    try:
        model.generate(**inputs, max_new_tokens=4, do_sample=False)
    finally:
        hook.remove()
    prefill_pos, decode_pos = seen[0], seen[1:]
    mm_oval.wrap(model, method="knorm", budget=0.25, recent_tokens=2)
    cache = prefill(model, **inputs)
    rope = cache.rope
    info = cache.info
    valid = info.positions >= 0
    # prompt: the M-RoPE ids the cache addresses by text position are the ones the model used
    ids = rope.ids(info.positions)
    assert torch.equal(ids[:, valid], prefill_pos[-3:][:, valid])
    # decode: text position next_pos + k continues as the model's own position ids do
    for k, pos in enumerate(decode_pos):
        nxt = rope.ids((info.next_pos + k).view(-1, 1))
        assert torch.equal(nxt, pos[-3:, :, -1:])
    # kept tokens keep their original ids, and cos/sin are the model's own rotary at those ids
    layer = cache.layers[0]
    kept = layer.slot_pos[:, 0, : layer.prompt_slots]
    ok = kept >= 0
    assert torch.equal(rope.ids(kept)[:, ok], _ids_of_slots(prefill_pos[-3:], layer)[:, ok])
    cos, sin = rope.cos_sin(info.positions)
    x = torch.zeros(1)
    mcos, msin = lm.rotary_emb(x, prefill_pos[-3:])
    torch.testing.assert_close(cos[valid], mcos.float()[valid])
    torch.testing.assert_close(sin[valid], msin.float()[valid])
    mm_oval.unwrap(model)


def _ids_of_slots(pos3, layer):
    src = layer.slot_src[:, 0, : layer.prompt_slots].clamp(min=0)
    return pos3.gather(2, src.unsqueeze(0).expand(3, -1, -1))


def test_qwen2_vl_shares_the_qwen2_5_vl_path():
    """Qwen2-VL (no window attention in its tower, the same grid_thw layout and M-RoPE): exact at budget
    1.0, a quarter of each sample's image tokens at 0.25."""
    from mm_oval.zoo.family import build_tiny_qwen2_vl

    model, processor = build_tiny_qwen2_vl()
    inputs = mixed_batch(processor)
    plain = _greedy(model, inputs)
    mm_oval.wrap(model, method="snapkv", budget=1.0)
    try:
        assert _greedy(model, inputs).sequences.tolist() == plain.sequences.tolist()
        mm_oval.wrap(model, method="knorm", budget=0.25, recent_tokens=2)
        cache = prefill(model, **inputs)
        want = budget_count(0.25, (cache.info.modality == IMAGE).sum(-1))
        kept = (cache.layers[0].slot_mod == IMAGE).sum(-1)
        assert torch.equal(kept, want.view(-1, 1).expand_as(kept))
    finally:
        mm_oval.unwrap(model)


def test_every_eviction_method_runs_or_is_refused_clearly(family):
    name, model, processor = family
    inputs = mixed_batch(processor)
    load_builtin_policies()
    options = {"fastv": {"layer": 0}, "kvp": None, "kvzip": {"tokenizer": "unused"}}
    for method in sorted(EVICTION_REGISTRY):
        if options.get(method, {}) is None:
            continue  # learned agents belong to one model: covered by the train-kvp smoke run
        cfg = {"method": method, "budget": 0.5, "method_options": options.get(method, {})}
        if method == "kvzip":  # its own pass over the prompt feeds LLaVA-1.5's inputs only
            with pytest.raises(ConfigError, match="kvzip .* does not run on"):
                mm_oval.wrap(model, **cfg)
            continue
        mm_oval.wrap(model, **cfg)
        seq = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert seq.shape[1] == inputs["input_ids"].shape[1] + 2, method
        assert get_stats(model)["image_kv_fraction_kept"] < 1.0, method


def test_chat_maps_kept_patches_and_page_reads_on_each_images_own_grids(family):
    name, model, processor = family
    mm_oval.unwrap(model)
    chat = Chat(
        model, processor, image=random_image(48, 80, 5), method="snapkv", budget=0.5, max_new_tokens=2
    )
    chat.ask("what color is the circle ?")
    shapes = chat.grids()
    assert shapes and all(r * c > 0 for r, c in shapes)
    kept = [chat.kept_image_tokens(g) for g in range(len(shapes))]
    for (r, c), k in zip(shapes, kept):
        assert k.shape[-2:] == (r, c)
    total = sum(r * c for r, c in shapes)
    per_head = sum(k[0].flatten(1).sum(1) for k in kept)  # layer 0, each KV head
    assert (
        per_head == budget_count(0.5, torch.tensor(total))
    ).all()  # half of every grid's patches, per head
    with pytest.raises(ConfigError, match="out of range"):
        chat.kept_image_tokens(len(shapes))
    with pytest.raises(ConfigError, match="chat.grids"):
        _ = chat.grid
    reader = Chat(model, processor, image=random_image(48, 80, 5), method="full:retrieval=quest,read_budget=0.5",
                  record_reads=True, max_new_tokens=3)  # fmt: skip
    reader.ask("what color is the circle ?")
    reads = [reader.page_reads(g) for g in range(len(reader.grids()))]
    assert all(r.shape[-2:] == s for r, s in zip(reads, reader.grids()))
    assert all(((r >= 0) & (r <= 1)).all() for r in reads) and any((r > 0).any() for r in reads)
