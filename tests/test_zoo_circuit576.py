"""The 576-token tiny LLaVA's closed-form language model, on exact patch codes (the image tokens the
projector writes when the vision tower's read-out is exact): every question type in the VQA, list and
MMBench formats and a conversation are answered right, so what the bundled checkpoint gets wrong is the
vision tower's doing, and what a KV-cache method gets wrong is the method's."""

from __future__ import annotations

import random

import pytest
import torch

from mm_oval.errors import ModelError
from mm_oval.prompts import chat_prompt
from mm_oval.zoo import circuit576
from mm_oval.zoo.build576 import build576
from mm_oval.zoo.generate576 import TRAIN_KINDS, make_questions576, to_mmbench
from mm_oval.zoo.scenes import GRID, make_scene
from mm_oval.zoo.vision576 import targets


@pytest.fixture(scope="module")
def written():
    torch.manual_seed(0)
    model, processor = build576(0)
    circuit576.set_language_model(model, processor.tokenizer)
    return model.eval(), processor


def answer(model, processor, scene, history, text, max_new=40) -> str:
    tok = processor.tokenizer
    prompt = chat_prompt(processor, text, history=history)
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    img = tok.convert_tokens_to_ids("<image>")
    k = ids.index(img)
    ids = ids[:k] + [img] * (GRID * GRID) + ids[k + 1 :]
    x = torch.tensor([ids])
    with torch.no_grad():
        emb = model.get_input_embeddings()(x)
        emb[0, k : k + GRID * GRID] = circuit576.image_embeddings(targets([scene]))[0]
        out = model.generate(
            inputs_embeds=emb, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False
        )
    return tok.decode(out[0], skip_special_tokens=True).strip()


def test_every_question_type_in_every_format(written):
    model, processor = written
    seen: set[str] = set()
    for seed in range(12):  # scenes until every type was asked (a list needs edges in the centres' order)
        rng = random.Random(seed)
        scene = make_scene(rng)
        for qtype, q in make_questions576(scene, rng).items():
            if qtype in seen:
                continue
            if qtype != "hint lookup":  # a hint lookup is a multiple-choice question only
                n = 40 if qtype == "list" else 3
                assert answer(model, processor, scene, [], q.vqa_prompt(), n) == q.answer, (qtype, q.text)
            if qtype != "list":
                mc = to_mmbench(scene, q, rng, hint_mode="distractor" if seed % 2 else "none")
                assert answer(model, processor, scene, [], mc.mmbench_prompt(), 3) == mc.answer, (
                    qtype,
                    mc.text,
                )
            seen.add(qtype)
        if len(seen) == len(TRAIN_KINDS):
            break
    assert seen == set(TRAIN_KINDS)


def test_a_conversation_answers_its_latest_question(written):
    model, processor = written
    rng = random.Random(5)
    scene = make_scene(rng)
    qs = [q for t, q in make_questions576(scene, rng).items() if t not in ("list", "hint lookup")]
    history: list[tuple[str, str]] = []
    for q in qs[:5]:
        assert answer(model, processor, scene, history, q.vqa_prompt(), 3) == q.answer, (len(history), q.text)
        history.append((q.vqa_prompt(), q.answer))


def test_the_circuit_checks_the_model_shape():
    from mm_oval.zoo.model import build_tiny_llava

    model, processor = build_tiny_llava(0)
    with pytest.raises(ModelError, match="576-token circuit"):
        circuit576.set_language_model(model, processor.tokenizer)
