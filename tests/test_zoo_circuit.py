"""The closed-form language model of the bundled tiny LLaVA (mm_oval/zoo/circuit.py): given exact patch
codes it must answer every question type of the benchmark, in both prompt formats, and stop after the
answer; the projector must turn an exact code into those image tokens."""

from contextlib import contextmanager

import pytest
import torch

from mm_oval.errors import ConfigError, ModelError
from mm_oval.zoo import circuit
from mm_oval.zoo.generate import GRID, TrainSampler
from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava
from mm_oval.zoo.train import TinyLlavaTrainConfig, patch_labels

pytestmark = pytest.mark.usefixtures("one_thread")
SIZES = TinyLlavaSizes(text_head_dim=64, rope_theta=1e6)


@pytest.fixture(scope="module")
def circuit_llava():
    model, proc = build_tiny_llava(seed=0, sizes=SIZES)
    circuit.set_language_model(model, proc.tokenizer)
    return model, proc


def _text(q) -> str:
    return q.mmbench_prompt() if q.options else q.vqa_prompt()


@contextmanager
def exact_codes(model):
    """Image tokens from the scene's exact patch code instead of the (random) tower: yields a function
    (scene image, scene, prompt) -> the generated tokens."""
    box = {}
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, out: box["emb"])

    def generate(proc, image, scene, prompt: str) -> list[str]:
        box["emb"] = circuit.image_embeddings(patch_labels(scene)[None])
        enc = proc(images=[image], text=[prompt], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=3, do_sample=False)
        return proc.tokenizer.convert_ids_to_tokens(out[0, enc["input_ids"].shape[1] :].tolist())

    try:
        yield generate
    finally:
        hook.remove()


def test_exact_patch_codes_answer_every_question_type_and_then_stop(circuit_llava):
    model, proc = circuit_llava
    sampler = TrainSampler(3, mmbench_fraction=0.5)
    seen, wrong = set(), []
    with exact_codes(model) as generate:
        for i in range(12):
            item = sampler.item(i, 12)
            for q in item.questions:
                msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _text(q)}]}]
                prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
                got = generate(proc, item.image, item.scene, prompt)
                seen.add((q.qtype, bool(q.options)))
                if got[:2] != [q.answer, proc.tokenizer.eos_token]:
                    wrong.append((q.qtype, q.answer, got))
    assert not wrong, wrong[:5]
    assert len(seen) == 11  # five VQA types, six multiple-choice ones (with the hint lookups)


def test_in_a_conversation_each_turn_answers_its_own_question(circuit_llava):
    """Later turns follow earlier questions and answers; the latest question's keys and options must win."""
    model, proc = circuit_llava
    sampler = TrainSampler(8, mmbench_fraction=0.5)
    wrong, turns = [], 0
    with exact_codes(model) as generate:
        for i in range(4):
            item = sampler.item(i, 4)
            conv = []
            for t, q in enumerate(item.questions):
                content = [{"type": "text", "text": _text(q)}]
                conv.append({"role": "user", "content": ([{"type": "image"}] if t == 0 else []) + content})
                prompt = proc.apply_chat_template(conv, add_generation_prompt=True)
                tokens = generate(proc, item.image, item.scene, prompt)
                answer = proc.tokenizer.convert_tokens_to_string(
                    [w for w in tokens if w not in proc.tokenizer.all_special_tokens]
                ).strip()
                conv.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
                turns += 1
                if answer != q.answer:
                    wrong.append((t, q.qtype, q.answer, answer))
    assert turns == 16 and not wrong, wrong


def test_projector_turns_an_exact_code_into_the_image_tokens():
    model, _ = build_tiny_llava(seed=0, sizes=SIZES)
    sampler = TrainSampler(4)
    labels = torch.stack([patch_labels(sampler.item(i, 0).scene) for i in range(24)])
    dim = model.config.vision_config.hidden_size
    feats = torch.zeros(*labels.shape[:-1], dim)
    feats[..., : circuit.CODE_SIZE] = circuit.code_targets(labels)  # a tower whose feature is the code
    code, report = circuit.projector_code(feats, labels)
    assert report["max_err"] < 1e-4
    circuit.set_projector(model, code)
    with torch.no_grad():
        got = model.model.multi_modal_projector(feats)
    torch.testing.assert_close(got, circuit.image_embeddings(labels), atol=1e-4, rtol=0)
    assert labels.shape[1] == GRID * GRID


def test_the_circuit_refuses_a_model_of_another_shape():
    model, proc = build_tiny_llava(seed=0)  # head_dim 32, RoPE theta 1e4
    with pytest.raises(ModelError, match="head_dim|theta"):
        circuit.set_language_model(model, proc.tokenizer)


def test_training_after_the_circuit_takes_the_language_loss_only():
    with pytest.raises(ConfigError, match="--attn-weight"):
        TinyLlavaTrainConfig(circuit=True, steps=10).validate()
    TinyLlavaTrainConfig(circuit=True, steps=10, attn_weight=0.0).validate()
    TinyLlavaTrainConfig(circuit=True, steps=0).validate()
    with pytest.raises(ConfigError, match="steps"):
        TinyLlavaTrainConfig(steps=0).validate()
