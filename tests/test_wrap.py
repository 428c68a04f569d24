"""mm_oval.wrap on the tiny random LLaVA: identical to the plain model when nothing is evicted (greedy,
sampling, batch with left padding, several images, multi-turn), exact attention over the kept tokens with
the original RoPE positions when something is, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import GPT2Config, GPT2LMHeadModel

import mm_oval
from mm_oval import wrapper
from mm_oval.config import OvalConfig
from mm_oval.errors import ConfigError, DataError, ModelError
from mm_oval.stats import get_stats
from mm_oval.training.router import new_router
from mm_oval.wrapper import prefill

QUESTIONS = [
    "what color is the circle ?",
    "how many red objects are there in the picture ?",
    "what shape is the blue object ?",
]


def _image(seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(128, 128, 3, generator=g) * 255).to(torch.uint8).numpy())


def _prompt(text: str, n_images: int = 1) -> str:
    return "USER: " + "<image>\n" * n_images + f"{text} ASSISTANT:"


def _batch(processor, n: int = 3):
    texts = [_prompt(q) for q in QUESTIONS[:n]]
    return processor(images=[_image(i) for i in range(n)], text=texts, return_tensors="pt", padding=True)


@pytest.fixture
def model_and_processor(tiny_random_llava):
    model, processor = tiny_random_llava
    yield model, processor
    mm_oval.unwrap(model)


def _greedy(model, inputs, n=6, **kw):
    return model.generate(
        **inputs, max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True, **kw
    )


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("cfg", [{}, {"method": "snapkv", "budget": 1.0}])
def test_nothing_evicted_generates_exactly_what_the_plain_model_does(model_and_processor, n, cfg):
    model, processor = model_and_processor
    inputs = _batch(processor, n)
    if n == 3:
        assert (inputs["attention_mask"] == 0).any(), "the batch must have left padding"
    plain = _greedy(model, inputs)
    mm_oval.wrap(model, **cfg)
    out = _greedy(model, inputs)
    assert out.sequences.tolist() == plain.sequences.tolist()
    for a, b in zip(out.scores, plain.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = get_stats(model)
    assert stats["kv_fraction_kept"] == 1.0
    assert stats["decode_steps"] == 5 and stats["prefill_s"] > 0
    json.dumps(stats)  # JSON-serialisable


def test_sampling_and_stopping_behave_as_in_hugging_face(model_and_processor):
    model, processor = model_and_processor
    inputs = _batch(processor, 2)
    kw = dict(max_new_tokens=5, do_sample=True, top_k=20, temperature=1.5)
    torch.manual_seed(123)
    plain = model.generate(**inputs, **kw)
    # stopping: with eos = the first generated token, generation stops there (then pads)
    first = int(plain[0, inputs["input_ids"].shape[1]])
    mm_oval.wrap(model)
    torch.manual_seed(123)
    assert model.generate(**inputs, **kw).tolist() == plain.tolist()
    stopped = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=first, pad_token_id=0)
    mm_oval.unwrap(model)
    ref = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=first, pad_token_id=0)
    assert stopped.tolist() == ref.tolist()


def test_several_images_per_prompt(model_and_processor):
    model, processor = model_and_processor
    inputs = processor(
        images=[_image(1), _image(2)], text=[_prompt("what color is the circle ?", 2)], return_tensors="pt"
    )
    plain = _greedy(model, inputs, n=4)
    mm_oval.wrap(model)
    assert _greedy(model, inputs, n=4).sequences.tolist() == plain.sequences.tolist()
    mm_oval.wrap(model, method="knorm", budget=0.25)
    cache = prefill(model, **inputs)
    layer = cache.layers[0]
    rc = layer.slot_rc[layer.slot_mod == 1]
    assert set(rc[:, 0].tolist()) == {0, 1}  # both images are there, each 8 x 8
    assert rc[:, 1:].max() == 7 and rc[:, 1:].min() == 0
    assert int((layer.slot_mod[0, 0] == 1).sum()) == 32  # 25% of 128 image tokens


def _compressed_reference(model, inputs, out_ids, kept_prompt):
    """The plain model over prompt + generated tokens, where generated tokens may not see evicted prompt
    tokens (same for every layer and head), with the original positions: the logits of each step."""
    am = inputs["attention_mask"].bool()
    B, N = am.shape
    T = out_ids.shape[1]
    full_am = torch.cat([am, torch.ones(B, T - N, dtype=torch.bool)], 1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal.view(1, 1, T, T) & full_am.view(B, 1, 1, T)
    mask[:, 0, N:, :N] &= kept_prompt.view(B, 1, N)
    mask |= torch.eye(T, dtype=torch.bool).view(1, 1, T, T)  # padding rows attend to themselves only
    pos = (full_am.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=out_ids, pixel_values=inputs["pixel_values"], attention_mask=mask, position_ids=pos
        ).logits
    return logits[:, N - 1 : T - 1]


def test_decode_attends_exactly_to_the_kept_tokens_at_their_original_positions(model_and_processor):
    """streamingllm keeps the same tokens in every layer and head, so the plain model with a custom mask
    computes what the compressed cache must: same logits, same greedy tokens (batch with left padding)."""
    model, processor = model_and_processor
    inputs = _batch(processor, 2)
    mm_oval.wrap(model, method="streamingllm", budget=0.25, text_budget=0.5, sink_tokens=2, recent_tokens=4)
    cache = prefill(model, **inputs)
    layer = cache.layers[0]
    B, N = inputs["input_ids"].shape
    kept = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        src = layer.slot_src[b, 0]
        kept[b, src[src >= 0]] = True
        # every head and layer kept the same tokens; their positions are the original ones
        for other in cache.layers:
            assert sorted(other.slot_src[b, 1][other.slot_src[b, 1] >= 0].tolist()) == sorted(
                src[src >= 0].tolist()
            )
        pos = inputs["attention_mask"][b].cumsum(0) - 1
        assert layer.slot_pos[b, 0][src >= 0].tolist() == pos[src[src >= 0]].tolist()
    out = model.generate(
        **inputs, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    assert cache.get_seq_length() == N  # prefill() cache untouched by generate (a fresh cache per call)
    mm_oval.unwrap(model)
    ref = _compressed_reference(model, inputs, out.sequences, kept)
    got = torch.stack(out.scores, 1)
    assert int(kept.sum()) < int(inputs["attention_mask"].sum())  # something was evicted
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_generate_sees_the_logical_length(model_and_processor):
    model, processor = model_and_processor
    inputs = _batch(processor, 1)
    mm_oval.wrap(model, method="tova", budget=0.1)
    cache = prefill(model, **inputs)
    N = inputs["input_ids"].shape[1]
    assert cache.get_seq_length() == N
    assert cache.layers[0].keys.shape[2] < N  # physically shorter
    out = model.generate(**inputs, max_new_tokens=7, do_sample=False, eos_token_id=None)
    assert out.shape[1] == N + 7


def test_multi_turn_compress_the_image_once_then_ask_several_questions(model_and_processor):
    model, processor = model_and_processor
    image_part = processor(images=[_image(5)], text=["USER: <image>\n"], return_tensors="pt")
    tok = processor.tokenizer
    questions = ["what color is the circle ? ASSISTANT:", "how many objects are there ? ASSISTANT:"]
    plain = []
    for q in questions:
        ids = torch.cat(
            [image_part["input_ids"], tok(q, add_special_tokens=False, return_tensors="pt").input_ids], 1
        )
        inp = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": image_part["pixel_values"],
        }
        plain.append(model.generate(**inp, max_new_tokens=4, do_sample=False))
    for cfg, same in (({}, True), ({"method": "snapkv", "budget": 0.25}, False)):
        mm_oval.wrap(model, **cfg)
        cache = prefill(model, **image_part)
        n_img_slots = cache.layers[1].keys.shape[2]
        for q, ref in zip(questions, plain):
            ids = torch.cat(
                [image_part["input_ids"], tok(q, add_special_tokens=False, return_tensors="pt").input_ids], 1
            )
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                cache=cache.copy(),
                max_new_tokens=4,
                do_sample=False,
            )
            assert out.shape == ref.shape
            if same:
                assert out.tolist() == ref.tolist()
        assert cache.layers[1].keys.shape[2] == n_img_slots  # the compressed prefix is shared, not grown
        if not same:
            assert n_img_slots < image_part["input_ids"].shape[1]


def test_unwrap_restores_the_plain_model(model_and_processor):
    model, processor = model_and_processor
    cls_generate = type(model).generate
    lm = model.model.language_model
    before = lm.config._attn_implementation
    attrs = set(vars(model))
    assert not mm_oval.is_wrapped(model)
    mm_oval.wrap(model, method="h2o", budget=0.5)
    assert mm_oval.is_wrapped(model)
    assert lm.config._attn_implementation == f"mm_oval_{before}"
    assert model.model.vision_tower.config._attn_implementation == before  # the vision tower is untouched
    mm_oval.wrap(model, method="knorm", budget=0.5)  # re-wrapping replaces the configuration
    assert wrapper.wrap_info(model).config.method == "knorm"
    mm_oval.unwrap(model)
    assert lm.config._attn_implementation == before
    assert model.generate.__func__ is cls_generate
    assert not mm_oval.is_wrapped(model) and set(vars(model)) == attrs  # nothing left on the model
    assert not model._forward_pre_hooks and not model._forward_hooks


def _hooks(model) -> int:
    """Forward hooks on the model and every submodule (the wrap puts some on the model, the language model
    and each attention module; Hugging Face installs its own output-capturing ones at the first forward)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _plain_state(model):
    """What a wrap changes on the model: its attention implementations, `generate`, hooks, attributes."""
    return (
        model.model.language_model.config._attn_implementation,
        model.model.vision_tower.config._attn_implementation,
        model.generate.__func__,
        _hooks(model),
        set(vars(model)),
    )


def test_the_scoped_wrap_restores_the_plain_model_on_exit_and_on_an_exception(model_and_processor):
    model, processor = model_and_processor
    inputs = _batch(processor, 1)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)  # Hugging Face's own hooks, installed once
    plain = _plain_state(model)
    assert plain[2] is type(model).generate and not mm_oval.is_wrapped(model)
    with mm_oval.wrapped(model, method="snapkv", budget=0.25) as m:
        assert m is model and mm_oval.is_wrapped(model)
        assert wrapper.wrap_info(model).config == OvalConfig(method="snapkv", budget=0.25)
        assert model.model.language_model.config._attn_implementation == f"mm_oval_{plain[0]}"
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        assert get_stats(model)["method"] == "snapkv"
    assert not mm_oval.is_wrapped(model) and _plain_state(model) == plain
    with pytest.raises(RuntimeError, match="inside the block"):
        with mm_oval.wrapped(model, OvalConfig(method="knorm", budget=0.5)):
            model.generate(**inputs, max_new_tokens=2, do_sample=False)
            raise RuntimeError("inside the block")
    assert not mm_oval.is_wrapped(model) and _plain_state(model) == plain
    with pytest.raises(ConfigError, match="out of range"):  # a wrap that fails: nothing to restore
        with mm_oval.wrapped(model, method="snapkv", budget=1.5):
            pass
    assert _plain_state(model) == plain
    with pytest.raises(ConfigError, match="not wrapped"):
        get_stats(model)


def test_the_scoped_wrap_gives_a_wrapped_model_its_own_wrap_back(model_and_processor):
    """Inside the block the model serves the block's configuration; after it (normally or by an exception)
    the earlier wrap's configuration, policies, attention implementation, hooks and last stats."""
    model, processor = model_and_processor
    inputs = _batch(processor, 1)
    mm_oval.wrap(model, method="knorm", budget=0.5)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    info, stats, state = wrapper.wrap_info(model), get_stats(model), _plain_state(model)
    for fail in (False, True):
        with pytest.raises(RuntimeError) if fail else _nothing():
            with mm_oval.wrapped(model, method="snapkv", budget=0.25, text_budget=0.5):
                inner = wrapper.wrap_info(model)
                assert inner.config.method == "snapkv" and inner.eviction is not info.eviction
                assert inner.attn_implementation == info.attn_implementation
                model.generate(**inputs, max_new_tokens=2, do_sample=False)
                assert get_stats(model)["method"] == "snapkv"
                if fail:
                    raise RuntimeError
        assert wrapper.wrap_info(model) == info and wrapper.wrap_info(model).eviction is info.eviction
        assert get_stats(model) is stats and _plain_state(model) == state
    model.generate(**inputs, max_new_tokens=2, do_sample=False)  # the earlier wrap serves again
    assert get_stats(model)["method"] == "knorm"
    # a wrap that fails inside leaves the earlier one in place
    with pytest.raises(ConfigError, match="unknown eviction method"):
        with mm_oval.wrapped(model, method="nope"):
            pass
    assert wrapper.wrap_info(model) == info and _plain_state(model) == state


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_wrap_serves_the_policies_it_is_given(model_and_processor):
    """wrap(..., eviction_policy=, retrieval_policy=): every request's cache serves exactly those objects;
    the configuration must name a method of each kind given."""
    model, processor = model_and_processor
    inputs = _batch(processor, 1)
    from mm_oval.registry import make_eviction, make_retrieval

    ev, rt = make_eviction("snapkv"), make_retrieval("quest")
    cfg = OvalConfig(method="snapkv", budget=0.25, retrieval="quest", read_budget=0.5)
    mm_oval.wrap(model, cfg, eviction_policy=ev, retrieval_policy=rt)
    info = wrapper.wrap_info(model)
    assert info.eviction is ev and info.retrieval is rt
    cache = wrapper.new_cache(model)
    assert cache.eviction is ev and cache.retrieval is rt
    cache = prefill(model, **inputs)
    assert cache.eviction is ev and cache.retrieval is rt and cache.copy().eviction is ev
    mm_oval.wrap(model, cfg)  # built by the wrap itself: new objects, the cache's are the same ones
    info = wrapper.wrap_info(model)
    assert info.eviction is not ev and wrapper.new_cache(model).retrieval is info.retrieval
    with pytest.raises(ConfigError, match="method is 'full'"):
        mm_oval.wrap(model, eviction_policy=ev)
    with pytest.raises(ConfigError, match="no retrieval"):
        mm_oval.wrap(model, method="snapkv", budget=0.25, retrieval_policy=rt)
    assert wrapper.wrap_info(model) == info  # the failed wraps left the model as it was


def test_clear_errors(model_and_processor):
    model, processor = model_and_processor
    # a decoder-only LM of a family the wrapper does not know (plain Llama/Mistral/Qwen2 LMs are wrapped)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32))
    with pytest.raises(ModelError, match="not a LLaVA-style model"):
        mm_oval.wrap(gpt2)
    with pytest.raises(ConfigError, match=r"out of range.*\(0, 1\]"):
        mm_oval.wrap(model, method="snapkv", budget=1.5)
    with pytest.raises(ConfigError, match="out of range"):
        mm_oval.wrap(model, method="snapkv", budget=0)
    with pytest.raises(ConfigError, match="unknown eviction method 'nope'; known methods: .*snapkv"):
        mm_oval.wrap(model, method="nope")
    with pytest.raises(ConfigError, match="unknown OvalConfig field"):
        mm_oval.wrap(model, budgett=0.5)
    assert not mm_oval.is_wrapped(model)  # a failed wrap leaves the model as it was
    mm_oval.wrap(model, method="knorm", budget=0.5)
    inputs = dict(_batch(processor, 1))
    inputs["pixel_values"] = inputs["pixel_values"].repeat(2, 1, 1, 1)  # two images, one <image> in the text
    with pytest.raises(DataError, match="64 image tokens but 2 image"):
        model.generate(**inputs, max_new_tokens=2)
    with pytest.raises(ConfigError, match="beam search"):
        model.generate(**_batch(processor, 1), max_new_tokens=2, num_beams=2)
    with pytest.raises(ConfigError, match="not wrapped"):
        get_stats(gpt2)


def test_stats_describe_the_last_request(model_and_processor):
    model, processor = model_and_processor
    inputs = _batch(processor, 3)
    mm_oval.wrap(model, OvalConfig(method="snapkv", budget=0.25))
    model.generate(**inputs, max_new_tokens=3, do_sample=False)
    s = get_stats(model)
    assert s["method"] == "snapkv" and len(s["layers"]) == 4
    row = s["layers"][0]
    assert row["image_tokens_full"] == 3 * 64 and row["image_tokens_kept"] == 3 * 16
    assert row["text_tokens_kept"] == row["text_tokens_full"]
    assert s["image_kv_fraction_kept"] == pytest.approx(0.25)


def test_a_request_checks_its_images_and_computes_its_stats_once(model_and_processor, monkeypatch):
    """generate, prefill, a plain forward and a request begun by new_request (then a forward, or generate)
    each check the images against the prompt once and compute the stats once; the request's state is in
    the cache's typed fields, nothing is left on the model."""
    model, processor = model_and_processor
    inputs = _batch(processor, 2)
    mm_oval.wrap(model, method="snapkv", budget=0.25)
    attrs = set(vars(model))
    calls = {"images": 0, "stats": 0}
    check, stats = wrapper._geometry, wrapper.cache_stats

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(wrapper, "_geometry", counted("images", check))
    monkeypatch.setattr(wrapper, "cache_stats", counted("stats", stats))
    model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert calls == {"images": 1, "stats": 1}
    assert get_stats(model)["layers"][0]["image_tokens_kept"] == 2 * 16
    cache = prefill(model, **inputs)
    assert calls == {"images": 2, "stats": 2}
    assert (cache.step.phase, cache.step.started, cache.step.new_valid) == ("prefill", None, None)
    assert cache.request.started is not None and cache.timings["prefill_s"] > 0
    cache = wrapper.new_cache(model)
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    assert calls == {"images": 3, "stats": 3}
    cache = wrapper.new_request(model, **inputs)
    assert calls == {"images": 4, "stats": 3} and cache.request.started is not None
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    assert calls == {"images": 4, "stats": 4}
    model.generate(**inputs, cache=wrapper.new_request(model, **inputs), max_new_tokens=2, do_sample=False)
    assert calls == {"images": 5, "stats": 5}
    with pytest.raises(ConfigError, match="already holds a request"):
        wrapper.new_request(model, cache=cache, **inputs)
    assert set(vars(model)) == attrs  # nothing left on the model


def test_the_wrapper_keeps_only_what_the_configured_policies_read(model_and_processor):
    """No hidden states, embeddings or final hidden state for a method that reads none of them; the
    router's (embeddings, last hidden state) when it is configured."""
    model, processor = model_and_processor
    inputs = _batch(processor, 1)
    mm_oval.wrap(model, method="snapkv", budget=0.25, retrieval="quest", read_budget=0.5)
    cache = prefill(model, **inputs)
    assert cache.request.inputs_embeds is None and cache.step.last_hidden is None
    assert cache.step.attention_inputs == {}
    torch.manual_seed(0)
    mm_oval.wrap(model, retrieval="router", read_budget=0.5, retrieval_options={"router": new_router(model)})
    cache = prefill(model, **inputs)
    B, N = inputs["input_ids"].shape
    hidden = model.config.text_config.hidden_size
    assert cache.request.inputs_embeds.shape == (B, N, hidden)
    assert cache.step.last_hidden.shape == (B, hidden)


def test_prefill_time_covers_the_vision_tower(model_and_processor, monkeypatch):
    """generate encodes the images before its first forward: that time is part of the prefill."""
    import time

    model, processor = model_and_processor
    inputs = _batch(processor, 1)
    mm_oval.wrap(model, method="snapkv", budget=0.25)
    tower = model.model.vision_tower
    forward, pause = tower.forward, 0.25

    def slow_forward(*args, **kwargs):
        time.sleep(pause)
        return forward(*args, **kwargs)

    monkeypatch.setattr(tower, "forward", slow_forward)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert get_stats(model)["prefill_s"] >= pause
    prefill(model, **inputs)  # the image encoded inside the forward
    assert get_stats(model)["prefill_s"] >= pause


def test_prefill_computes_the_logits_of_the_last_position_only(model_and_processor):
    model, processor = model_and_processor
    inputs = _batch(processor, 2)
    with torch.no_grad():
        full = model(**inputs).logits
    assert full.shape[1] == inputs["input_ids"].shape[1]
    mm_oval.wrap(model, method="snapkv", budget=0.25)
    seen = []
    hook = model.register_forward_hook(lambda module, args, output: seen.append(output.logits))
    try:
        prefill(model, **inputs)
    finally:
        hook.remove()
    (logits,) = seen
    assert logits.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(logits[:, 0], full[:, -1], atol=1e-4, rtol=1e-4)
    assert logits[:, 0].argmax(-1).tolist() == full[:, -1].argmax(-1).tolist()


def test_wraps_the_models_own_attention_implementation_eager_too():
    from mm_oval.zoo.model import build_tiny_llava

    model, processor = build_tiny_llava(seed=2, attn_implementation="eager")
    inputs = _batch(processor, 2)
    plain = _greedy(model, inputs, n=4)
    mm_oval.wrap(model)
    assert model.model.language_model.config._attn_implementation == "mm_oval_eager"
    out = _greedy(model, inputs, n=4)
    assert out.sequences.tolist() == plain.sequences.tolist()
    for a, b in zip(out.scores, plain.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    mm_oval.wrap(model, method="snapkv", budget=0.25)
    assert (
        model.generate(**inputs, max_new_tokens=2, do_sample=False).shape[1]
        == inputs["input_ids"].shape[1] + 2
    )
    assert get_stats(model)["image_kv_fraction_kept"] == pytest.approx(0.25)
    mm_oval.unwrap(model)
    assert model.model.language_model.config._attn_implementation == "eager"


def test_a_batch_of_conversations_with_padded_next_turns_matches_the_plain_model(model_and_processor):
    """Turn 2 of two conversations, fed on top of the cache with padding inside the new tokens (the
    shorter question is left-padded): the padding is masked as transformers' own cache masks it."""
    from transformers import DynamicCache

    model, processor = model_and_processor
    first = _batch(processor, 2)
    tok = processor.tokenizer
    tails = ["what shape is it ? ASSISTANT:", "what color is the big square in the left row ? ASSISTANT:"]
    tail = tok(tails, add_special_tokens=False, return_tensors="pt", padding=True)
    assert (tail["attention_mask"] == 0).any()

    def two_turns(cache):
        kw = dict(max_new_tokens=3, do_sample=False, eos_token_id=None)
        seq = model.generate(**first, cache=cache, **kw)
        am = torch.cat([first["attention_mask"], torch.ones(2, 3, dtype=torch.long)], 1)
        ids = torch.cat([seq, tail["input_ids"]], 1)
        am = torch.cat([am, tail["attention_mask"]], 1)
        return model.generate(
            input_ids=ids,
            attention_mask=am,
            cache=cache,
            output_scores=True,
            return_dict_in_generate=True,
            **kw,
        )

    plain = two_turns(DynamicCache(config=model.config.get_text_config()))
    mm_oval.wrap(model)
    from mm_oval.wrapper import new_cache

    out = two_turns(new_cache(model))
    assert out.sequences.tolist() == plain.sequences.tolist()
    for a, b in zip(out.scores, plain.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
