"""`mm_oval.wrap` on a plain decoder-only LM (the language models LLaVA-style models are built on): the same
cache with text pages only, budgets over the context, and the long-context text tasks in the harness."""

import json

import pytest
import torch
from mm_oval.eval import longtext
from mm_oval.eval.runner import evaluate
from mm_oval.eval.tasks import get_task, resolve_data
from mm_oval.eval.textgen import generate_text, generate_text_conversation
from transformers import GPT2Config, GPT2LMHeadModel

import mm_oval
from mm_oval.errors import ConfigError, DataError, ModelError
from mm_oval.stats import get_stats

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 300, (2, 120), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # the second prompt is shorter: left padding
    return ids, mask


GEN = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "full"},
        {"method": "snapkv", "budget": 1.0},
        {"method": "expected_attention", "budget": 1.0},
        {"method": "full", "retrieval": "quest", "read_budget": 1.0},
        {"method": "full", "retrieval": "oval", "read_budget": 1.0},
    ],
)
def test_budget_one_gives_the_unwrapped_models_tokens_with_padding(tiny_lm, spec):
    ids, mask = _batch()
    with torch.no_grad():
        ref = tiny_lm.generate(input_ids=ids, attention_mask=mask, **GEN)
    mm_oval.wrap(tiny_lm, **spec)
    try:
        with torch.no_grad():
            out = tiny_lm.generate(input_ids=ids, attention_mask=mask, **GEN)
    finally:
        mm_oval.unwrap(tiny_lm)
    assert torch.equal(out, ref)


def test_the_budget_is_a_share_of_the_context(tiny_lm):
    ids, mask = _batch()
    mm_oval.wrap(tiny_lm, method="snapkv", budget=0.25)
    try:
        with torch.no_grad():
            tiny_lm.generate(input_ids=ids, attention_mask=mask, **GEN)
        stats = get_stats(tiny_lm)
    finally:
        mm_oval.unwrap(tiny_lm)
    layer = stats["layers"][0]
    # 120 + 97 context tokens, a quarter of each sample's kept (rounded up per sample)
    assert layer["text_tokens_full"] == 217
    assert layer["text_tokens_kept"] == 30 + 25
    assert stats["kv_fraction_kept"] == pytest.approx(0.25, abs=0.01)


def test_retrieval_reads_text_pages_selectively(tiny_lm):
    ids, mask = _batch()
    mm_oval.wrap(tiny_lm, retrieval="quest", read_budget=0.25)
    try:
        with torch.no_grad():
            tiny_lm.generate(input_ids=ids, attention_mask=mask, **GEN)
        read = get_stats(tiny_lm)["bytes_read"]
    finally:
        mm_oval.unwrap(tiny_lm)
    assert 0 < read["per_step"]["selected"]
    assert read["read_vs_dense"] < 0.8


def test_a_plain_lm_refuses_pixel_values_and_two_budgets(tiny_lm):
    ids, mask = _batch()
    mm_oval.wrap(tiny_lm)
    try:
        with pytest.raises(ConfigError, match="without a vision tower"):
            tiny_lm.generate(input_ids=ids, attention_mask=mask, pixel_values=torch.zeros(2, 3, 8, 8), **GEN)
    finally:
        mm_oval.unwrap(tiny_lm)
    with pytest.raises(ConfigError, match="one context budget"):
        mm_oval.wrap(tiny_lm, method="snapkv", budget=0.25, text_budget=0.5)
    assert not mm_oval.is_wrapped(tiny_lm)


def test_a_model_that_cannot_be_wrapped_is_refused_naming_the_plain_lms_wrap_takes():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ModelError, match="LlamaForCausalLM"):
        mm_oval.wrap(gpt2, method="snapkv", budget=0.5)


# ---- the long-context text tasks --------------------------------------------------------------------------
SMALL = {"seed": 7, "per_length": 2, "lengths": {"1k": 6, "2k": 8, "4k": 10}}


def test_the_dev_sets_are_a_seed_same_items_every_time():
    a = longtext.generate("doorkeys", "1k", SMALL)
    b = longtext.generate("doorkeys", "1k", SMALL)
    assert [(i.id, i.context, i.prompt, i.meta) for i in a] == [
        (i.id, i.context, i.prompt, i.meta) for i in b
    ]
    assert len(a) == 8 and len({i.group for i in a}) == 2  # four doors per context
    for it in a:
        assert f"door is {it.meta['key']}." in it.context and it.meta["key"] not in it.prompt
    duo = longtext.generate("duo", "1k", SMALL)
    assert len(duo) == 4 and [i.group for i in duo] == ["1k-0", "1k-0", "1k-1", "1k-1"]
    assert all(i.meta.get("key", i.meta.get("word")) in i.context for i in duo)
    other = longtext.generate("doorkeys", "1k", {**SMALL, "seed": 8})
    assert [i.context for i in other] != [i.context for i in a]
    bundled = get_task("passkey_1k").load(resolve_data("bundled", get_task("passkey_1k")))
    assert len(bundled) == longtext.BUNDLED_SPEC["per_length"]


def test_answers_are_scored_exactly():
    assert longtext.score_item("passkey", "The pass key is 12345.", {"key": "12345"})["accuracy"] == 1
    assert longtext.score_item("passkey", "It is 54321, not 12345.", {"key": "12345"})["accuracy"] == 0
    assert longtext.score_item("passkey", "123456", {"key": "12345"})["accuracy"] == 0
    assert longtext.score_item("passkey", None, {"key": "12345"})["accuracy"] == 0
    row = longtext.score_item(
        "keylist", "11111, 22222, 44444, 33333", {"keys": ["11111", "22222", "33333", "44444"]}
    )
    assert row == {"accuracy": 0.0, "keys_in_place": 0.5}
    assert longtext.score_item("needle", "Saffron.", {"word": "saffron"})["accuracy"] == 1
    assert longtext.score_item("needle", "saffronish", {"word": "saffron"})["accuracy"] == 0


def test_a_bad_spec_names_the_file(tmp_path):
    (tmp_path / "longtext.json").write_text('{"seed": 1, "per_length": 0, "lengths": {}}')
    with pytest.raises(DataError, match="longtext.json"):
        get_task("passkey_1k").load(tmp_path)
    (tmp_path / "longtext.json").write_text(json.dumps({**SMALL, "lengths": {"2k": 8}}))
    with pytest.raises(DataError, match="no length '1k'"):
        get_task("passkey_1k").load(tmp_path)


def test_a_folder_without_a_spec_is_refused_not_read_as_the_bundled_dev_set(tmp_path):
    with pytest.raises(DataError, match="no longtext.json here.*--data bundled"):
        get_task("passkey_1k").load(tmp_path)
    bundled = get_task("passkey_1k").load(resolve_data("bundled", get_task("passkey_1k")), limit=2)
    assert [it.id for it in bundled] == ["1k-0", "1k-1"]


def test_the_harness_runs_a_text_task_question_agnostic_and_in_turns(tiny_lm, byte_tokenizer, tmp_path):
    (tmp_path / "longtext.json").write_text(json.dumps(SMALL))
    items = get_task("duo_1k").load(tmp_path)
    # the full cache: reading the question from the prefilled context gives the tokens of one prefill
    agnostic = generate_text(tiny_lm, byte_tokenizer, items[:2], 6, compress="context")
    whole = generate_text(tiny_lm, byte_tokenizer, items[:2], 6, compress="prompt")
    assert agnostic == whole
    # wrapped at budget 1.0 the same answers, question-agnostic and as a conversation over one cache
    mm_oval.wrap(tiny_lm, method="snapkv", budget=1.0)
    try:
        assert generate_text(tiny_lm, byte_tokenizer, items[:2], 6, compress="context") == whole
        turns = generate_text_conversation(tiny_lm, byte_tokenizer, items[:2], 6)
    finally:
        mm_oval.unwrap(tiny_lm)
    assert turns == generate_text_conversation(tiny_lm, byte_tokenizer, items[:2], 6)
    assert turns[0] == whole[0]
    r = evaluate(
        tiny_lm,
        byte_tokenizer,
        "duo_1k",
        tmp_path,
        method="snapkv",
        budget=0.5,
        compress="context",
        out_dir=tmp_path / "run",
        progress=False,
        max_new_tokens=4,
    )
    assert r["scores"]["count"] == 4 and r["kv"]["kv_fraction_kept"] == pytest.approx(0.5, abs=0.02)
    assert not mm_oval.is_wrapped(tiny_lm)
    with pytest.raises(ConfigError, match="'image' is for image tasks"):
        evaluate(tiny_lm, byte_tokenizer, "duo_1k", tmp_path, compress="image", progress=False)


@pytest.mark.real_lm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_budget_one_on_smollm2_gives_its_own_tokens(smollm2, dtype):
    """SmolLM2 wrapped at budget 1.0 (and reading every page) answers with the unwrapped model's tokens,
    greedy, a batch of two prompts of different lengths (left padding)."""
    import copy

    base, tok = smollm2
    model = copy.deepcopy(base).to(dtype)
    tok.padding_side = "left"
    questions = ["What is the capital of France? Answer in one word.", "Name two colours of the rainbow."]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert not bool(enc["attention_mask"].all())  # the shorter prompt is padded
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.no_grad():
        ref = model.generate(**enc, **kw)
    for spec in ({"method": "snapkv", "budget": 1.0}, {"retrieval": "oval", "read_budget": 1.0}):
        with mm_oval.wrapped(model, **spec), torch.no_grad():
            assert torch.equal(model.generate(**enc, **kw), ref), spec
