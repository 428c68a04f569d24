import json

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mm_oval.zoo.generate import TrainSampler
from mm_oval.zoo.model import build_tiny_llava
from mm_oval.zoo.train import Encoder, TinyLlavaTrainConfig, Trainer, make_batch


def test_tree_batch_scores_each_question_exactly_as_a_single_turn_prompt():
    """Training packs many questions after one image; each must see exactly the evaluation prompt."""
    model, proc = build_tiny_llava(seed=0, attn_implementation="eager")
    enc = Encoder(proc.tokenizer)
    items = [TrainSampler(0, mmbench_fraction=0.5).item(i, 3) for i in range(2)]
    batch = make_batch(items, enc)
    with torch.no_grad():
        packed = model(
            input_ids=batch.input_ids,
            pixel_values=batch.pixel_values,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
        for j, (b, a) in enumerate(batch.answer_rows.tolist()):
            q = items[b].questions[j % 3]
            text = q.mmbench_prompt() if q.options else q.vqa_prompt()
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
            single = model(**proc(images=[items[b].image], text=[prompt], return_tensors="pt")).logits[0, -1]
            torch.testing.assert_close(packed[b, a], single, atol=1e-4, rtol=1e-4)
            assert proc.tokenizer.convert_ids_to_tokens(int(batch.labels[b, a])) == q.answer


def test_training_smoke_resumes_and_exports_a_plain_llava(tmp_path):
    cfg = TinyLlavaTrainConfig(steps=2, vision_steps=2, vision_batch=2, images_per_batch=2, questions_per_image=4,
                      eval_every=2, eval_items=2, warmup=1, projector_steps=2)  # fmt: skip
    Trainer(tmp_path, cfg).run()
    assert json.loads((tmp_path / "train_log.jsonl").read_text().splitlines()[-1])["step"] == 2
    cfg.steps = 3  # a longer run in the same directory resumes from the saved state
    out = Trainer(tmp_path, cfg).run()
    steps = [json.loads(x).get("step") for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert steps[-1] == 3 and steps.count(1) == 0
    model = LlavaForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.num_key_value_heads < model.config.text_config.num_attention_heads
    assert AutoProcessor.from_pretrained(out).tokenizer.convert_tokens_to_ids("red") > 0


def test_letter_teacher_points_each_option_word_at_its_own_letter():
    _, proc = build_tiny_llava(seed=0, attn_implementation="eager")
    enc = Encoder(proc.tokenizer)
    items = [TrainSampler(0, mmbench_fraction=1.0).item(i, 3) for i in range(2)]
    assert (0, 2) not in make_batch(items, enc).teach
    bi, qi, km = make_batch(items, enc, letter_teacher=True).teach[(0, 2)]
    ids = make_batch(items, enc).input_ids
    n_options = sum(len(q.options) for it in items for q in it.questions)
    assert len(qi) == n_options  # one-word options: one row per option
    for b, q, row in zip(bi.tolist(), qi.tolist(), km):
        (letter,) = row.nonzero().flatten().tolist()
        assert letter == q - 2  # "B", ".", then the option's word
        assert proc.tokenizer.convert_ids_to_tokens(int(ids[b, letter])) in "ABCD"


def test_init_from_continues_another_runs_weights_with_a_fresh_schedule(tmp_path):
    cfg = TinyLlavaTrainConfig(steps=1, vision_steps=1, vision_batch=2, images_per_batch=2, questions_per_image=2,
                      eval_every=5, eval_items=2, warmup=1, projector_steps=1)  # fmt: skip
    first = Trainer(tmp_path / "a", cfg)
    first.run()
    cfg2 = TinyLlavaTrainConfig(**{**cfg.__dict__, "init_from": str(tmp_path / "a" / "train_state.ckpt.pt"),
                          "letter_teacher": True, "readout_weight": 1.0, "mmbench_fraction": 1.0,
                          "steps": 1})  # fmt: skip
    second = Trainer(tmp_path / "b", cfg2)
    second.run()
    log = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["stage"] == "init" and log[0]["from_step"] == 1
    assert not any(r.get("stage") == "vision" for r in log)  # no vision / projector stage again
    state = torch.load(tmp_path / "b" / "train_state.ckpt.pt", weights_only=True)  # plain data only
    assert state["step"] == 1


def test_readout_loss_reads_the_letter_from_one_heads_contribution():
    cfg = TinyLlavaTrainConfig(
        images_per_batch=1, questions_per_image=3, mmbench_fraction=1.0, readout_weight=1.0
    )
    t = Trainer("/tmp/unused", cfg)
    from mm_oval.zoo.train import make_batch

    batch = make_batch([t.sampler.item(0, 3)], t.enc)
    attn = t.model.model.language_model.layers[2].self_attn
    x = torch.zeros(*batch.input_ids.shape, attn.o_proj.in_features, requires_grad=True)
    loss = t.readout_loss(x, batch)
    loss.backward()
    # only head 0's slice at the answer positions gets a gradient
    grad = x.grad.abs().sum(-1)
    b, a = batch.answer_rows[:, 0], batch.answer_rows[:, 1]
    assert float(grad[b, a].min()) > 0 and float(grad.sum()) == float(grad[b, a].sum())
    assert float(x.grad[..., attn.head_dim :].abs().sum()) == 0.0


def test_type_weights_oversample_a_question_type_and_reject_unknown_types():
    import pytest

    from mm_oval.errors import ConfigError
    from mm_oval.zoo.train import parse_type_weights

    def share(sampler):
        qs = [q for i in range(40) for q in sampler.item(i, 8).questions]
        return sum(q.qtype == "color of shape" for q in qs) / len(qs)

    base = TrainSampler(0, mmbench_fraction=0.0)
    more = TrainSampler(0, mmbench_fraction=0.0, type_weights=parse_type_weights("color of shape=6"))
    assert share(more) > 2 * share(base)
    assert parse_type_weights("") is None
    with pytest.raises(ConfigError, match="unknown types"):
        TrainSampler(0, type_weights={"colour of shape": 2.0})
    with pytest.raises(ConfigError, match="type=weight"):
        parse_type_weights("color of shape")


def test_circuit_recipe_smoke_exports_a_plain_llava(tmp_path):
    """--circuit: vision stage on the patch code, closed-form projector and language model, no LM steps."""
    cfg = TinyLlavaTrainConfig(
        circuit=True, steps=0, vision_steps=2, vision_batch=2, eval_items=1, questions_per_image=4
    )
    out = Trainer(tmp_path, cfg).run()
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert "code_fit" in log[0] and "heldout" in log[-1]
    model = LlavaForConditionalGeneration.from_pretrained(out)
    assert model.config.text_config.head_dim == 64
