"""`mm-oval zoo check` at any geometry: the grid comes from the model (and the data's meta), the question
types from the data; a blank image scores no better than the answer prior on every bundled model."""

import json
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest
import torch
from PIL import Image

from mm_oval.cli import main
from mm_oval.errors import DataError
from mm_oval.modelfiles import load_model
from mm_oval.prompts import chat_prompt, short_answer_prompt
from mm_oval.zoo import bundled_data_dir
from mm_oval.zoo.check import (
    answer_prior,
    blank_above_prior,
    bundled_data_for_grid,
    first_token_answers,
    grounding_report,
    load_vqa_items,
    model_grid,
)
from mm_oval.zoo.generate import image_name
from mm_oval.zoo.model import TinyLlavaSizes, build_tiny_llava

pytestmark = pytest.mark.usefixtures("one_thread")

# (model folder in mm_oval.zoo, dev-set folder in mm_oval.eval/data): every bundled model with its dev sets
BUNDLED = [("tiny_llava", "synth"), ("tiny_llava576", "synth576")]


def bundled_pair(model_name: str, data_name: str):
    model_dir = Path(str(resources.files("mm_oval.zoo") / model_name))
    data_dir = Path(str(resources.files("mm_oval.eval") / "data" / data_name))
    if not (model_dir / "model.safetensors").is_file():
        pytest.skip(f"the bundled model mm_oval/zoo/{model_name} is not built (no model.safetensors)")
    if not (data_dir / "targets.json").is_file():
        pytest.skip(f"the bundled dev sets eval/data/{data_name} are not generated (no targets.json)")
    return model_dir, data_dir


@pytest.mark.parametrize(("model_name", "data_name"), BUNDLED)
def test_a_blank_image_scores_no_better_than_the_answer_prior(model_name, data_name, request):
    """With a blank image the model can only answer from the question's text: per type at most the share of
    the type's most frequent answer, plus two binomial standard errors at the type's question count (about
    0.10-0.13 at 60 questions). Measured on the 64-token model (300 questions): blank accuracy equals the
    prior on 'color at position' (0.183) and 'exists' (0.567) and is below it elsewhere (counts: 0.067 vs
    0.717, since a blank image truly holds 0 objects). The margin is what separates guessing from seeing:
    the same model's real-image answers exceed it on every type, so a model whose blank-image answers were
    still right would fail here."""
    model_dir, data_dir = bundled_pair(model_name, data_name)
    model, processor = load_model(model_dir, "cpu")
    if model_grid(model) > 8:  # 576 image tokens per prompt: large enough for every thread to help
        request.getfixturevalue("all_threads")
    items = load_vqa_items(data_dir, grid=model_grid(model))
    blank, _ = first_token_answers(model, processor, items, data_dir, blank=True)
    assert blank_above_prior(items, blank) == {}
    real, _ = first_token_answers(model, processor, items, data_dir)
    assert set(blank_above_prior(items, real)) == set(answer_prior(items))


def test_the_prior_check_flags_answers_beyond_the_prior_and_passes_guessing():
    items = load_vqa_items(bundled_data_dir())
    prior = answer_prior(items)
    mode = {t: Counter(it["answer"] for it in items if it["type"] == t).most_common(1)[0][0] for t in prior}
    # always the type's most frequent answer: exactly the prior, never flagged
    assert blank_above_prior(items, [mode[it["type"]] for it in items]) == {}
    # right answers on one type only: that type is flagged, with its figures
    right_on = "color of shape"
    answers = [it["answer"] if it["type"] == right_on else mode[it["type"]] for it in items]
    flagged = blank_above_prior(items, answers)
    assert list(flagged) == [right_on]
    assert flagged[right_on]["blank"] == 1.0 and flagged[right_on]["prior"] == pytest.approx(prior[right_on])
    assert 0.05 < flagged[right_on]["margin"] < 0.15 and flagged[right_on]["questions"] == 60


def test_the_bundled_report_reads_its_grid_and_shows_per_type_attention_on_the_targets(tiny_bundled):
    model, processor = tiny_bundled
    report = grounding_report(limit=100, model=model, processor=processor)
    assert report["grid"] == 8
    by_type = report["attention_on_targets_by_type"]
    assert set(by_type) == {it["type"] for it in load_vqa_items(bundled_data_dir(), limit=100)}
    for t, fig in by_type.items():
        # one target cell of 64 (counts: every cell of the colour, often none) -> about 1/64
        assert 1 / 64 <= fig["uniform_share"] <= 3 / 64, t
        # the bundled model's layer-2 retrieval head lands on the answer's cells for every question type
        best = fig["layers"]["layer2"]
        assert best["best_head_mass"] >= max(0.5, 10 * fig["uniform_share"]), (t, best)
        assert best["mean_over_heads"] <= best["best_head_mass"]


@pytest.fixture(scope="module")
def tiny_bundled():
    from mm_oval.zoo import bundled_model_path

    return load_model(bundled_model_path(), "cpu", attn_implementation="eager")


# ---- a random tiny LLaVA at a 12x12 grid (96 px, patch 8) and a dev set of new question types --------------

GRID = 12
TYPES = {
    "left of": "is the red circle left of the blue square ?",
    "above": "is the red circle above the blue square ?",
}


@pytest.fixture(scope="module")
def grid12(tmp_path_factory):
    sizes = TinyLlavaSizes(image_size=96, patch_size=8, text_layers=2, vision_layers=1)
    model, processor = build_tiny_llava(seed=1, sizes=sizes, attn_implementation="eager")
    data = tmp_path_factory.mktemp("synth12")
    (data / "images").mkdir()
    questions, targets = [], {}
    g = torch.Generator().manual_seed(0)
    for image_id in range(3):
        pixels = (torch.rand(96, 96, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(data / "images" / image_name(image_id))
        for k, (qtype, text) in enumerate(TYPES.items()):
            qid = image_id * 1000 + k
            questions.append({"question_id": qid, "image_id": image_id, "question": text})
            cells = [[image_id, k], [GRID - 1, GRID - 1 - image_id]][: 1 + (qid % 2)]
            targets[str(qid)] = {"type": qtype, "answer": "yes" if image_id % 2 else "no", "targets": cells}
    (data / "vqav2_dev_questions.json").write_text(json.dumps({"questions": questions}))
    (data / "targets.json").write_text(json.dumps({"meta": {"grid": GRID}, "vqav2": targets}))
    return model, processor, data


def attention_on(model, processor, data, item) -> torch.Tensor:
    """(layers, heads) attention mass from the last position on the item's target patches, one prompt alone."""
    image = Image.open(data / "images" / image_name(item["image_id"])).convert("RGB")
    text = chat_prompt(processor, short_answer_prompt(item["question"]))
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, use_cache=False)
    first = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0])
    idx = [first + r * GRID + c for r, c in item["targets"]]
    return torch.stack([a[0, :, -1, idx].sum(-1) for a in out.attentions])


def test_the_report_takes_the_grid_from_the_model_and_the_types_from_the_data(grid12):
    model, processor, data = grid12
    report = grounding_report(data_dir=data, model=model, processor=processor)
    assert report["grid"] == GRID and report["questions"] == 6
    assert set(report["accuracy"]) == {*TYPES, "all"} and set(report["answer_prior"]) == set(TYPES)
    items = load_vqa_items(data, grid=GRID)
    for qtype, fig in report["attention_on_targets_by_type"].items():
        mine = [it for it in items if it["type"] == qtype]
        assert fig["questions"] == len(mine)
        assert fig["uniform_share"] == round(sum(len(it["targets"]) for it in mine) / len(mine) / GRID**2, 3)
        # (layers, heads): each head's mass on the targets, averaged over the type's questions
        heads = torch.stack([attention_on(model, processor, data, it) for it in mine]).mean(0)
        for i, layer in enumerate(heads):
            got = fig["layers"][f"layer{i}"]
            assert got["best_head"] == int(layer.argmax())
            assert got["best_head_mass"] == pytest.approx(float(layer.max()), abs=1.5e-3)
            assert got["mean_over_heads"] == pytest.approx(float(layer.mean()), abs=1.5e-3)


def test_data_for_another_grid_or_targets_outside_it_are_clear_errors(grid12, tmp_path):
    model, processor, data = grid12
    with pytest.raises(
        DataError, match=r"targets\.json is for a 8x8 patch grid but the model's image is 12x12"
    ):
        grounding_report(data_dir=bundled_data_dir(), model=model, processor=processor)
    table = json.loads((data / "targets.json").read_text())
    del table["meta"]
    table["vqav2"]["1000"]["targets"] = [[3, GRID]]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "targets.json").write_text(json.dumps(table))
    (bad / "vqav2_dev_questions.json").write_text((data / "vqav2_dev_questions.json").read_text())
    with pytest.raises(DataError, match=r"question_id 1000 has target \[3, 12\].*of a 12x12 grid"):
        load_vqa_items(bad, grid=GRID)
    with pytest.raises(DataError, match="no bundled dev set .* 12x12 patch grid.*pass --data"):
        bundled_data_for_grid(GRID)
    assert bundled_data_for_grid(8) == bundled_data_dir()


def test_zoo_check_command_needs_only_the_model_and_the_data(grid12, tmp_path, capsys):
    model, processor, data = grid12
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    out = tmp_path / "report.json"
    assert main(["zoo", "check", "--model", str(model_dir), "--data", str(data), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["grid"] == GRID and set(report["attention_on_targets_by_type"]) == set(TYPES)
