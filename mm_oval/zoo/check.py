"""Grounding check of a tiny LLaVA checkpoint on the bundled VQA-format dev questions.

Three figures, all from the first greedy answer token of the single-turn evaluation prompt:
- accuracy per question type with the real image;
- the same with a blank image (what the model can guess from the text alone: near the answer prior);
- the attention mass from the answer position on the question's target patches (the cells that hold
  the answer, as the generator knows them), per layer, against the mass a uniform spread over the
  image would give. This is the quick evaluator of the zoo; the official scores come from mm_oval.eval.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from pathlib import Path

import torch
from PIL import Image

from ..errors import DataError
from ..modelfiles import load_model
from ..prompts import chat_prompt, short_answer_prompt
from . import bundled_data_dir, bundled_model_path
from .generate import BACKGROUND, GRID, IMAGE_SIZE, image_name

log = logging.getLogger(__name__)


def load_vqa_items(data_dir: Path, limit: int | None = None) -> list[dict]:
    """The dev VQA questions with canonical answer, type and target cells."""
    qpath, tpath = data_dir / "vqav2_dev_questions.json", data_dir / "targets.json"
    for p in (qpath, tpath):
        if not p.is_file():
            raise DataError(
                f"{p} is missing; regenerate the dev sets with `mm-oval zoo generate --out {data_dir}`"
            )
    questions = json.loads(qpath.read_text())["questions"]
    targets = json.loads(tpath.read_text())["vqav2"]
    items = []
    for i, q in enumerate(questions[:limit] if limit else questions):
        t = targets.get(str(q["question_id"]))
        if t is None:
            raise DataError(f"{tpath}: no entry for question_id {q['question_id']} (row {i} of {qpath})")
        items.append({**q, **t})
    return items


@torch.no_grad()
def first_token_answers(model, processor, items: list[dict], data_dir: Path, blank: bool = False, batch_size: int = 32,
                        want_attention: bool = False) -> tuple[list[str], list[dict]]:  # fmt: skip
    """Greedy first answer word per item (and, when asked, per-layer attention mass on the targets)."""
    tok = processor.tokenizer
    image_id = model.config.image_token_id
    preds, attn = [], []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        prompts = [chat_prompt(processor, short_answer_prompt(it["question"])) for it in chunk]
        if blank:
            images = [Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND) for _ in chunk]
        else:
            images = [
                Image.open(data_dir / "images" / image_name(it["image_id"])).convert("RGB") for it in chunk
            ]
        inputs = processor(images=images, text=prompts, return_tensors="pt", padding=True)
        out = model(**inputs, output_attentions=want_attention, use_cache=False)
        preds += tok.convert_ids_to_tokens(out.logits[:, -1].argmax(-1).tolist())
        if want_attention:
            for b, it in enumerate(chunk):
                img_pos = (inputs["input_ids"][b] == image_id).nonzero().flatten()
                cells = [img_pos[r * GRID + c] for r, c in it["targets"]]
                per_layer = []
                for layer_att in out.attentions:
                    row = layer_att[b, :, -1].float()  # (heads, L)
                    on_t = row[:, cells].sum(-1) if cells else torch.zeros(row.shape[0])
                    per_layer.append({"target_mean": float(on_t.mean()), "target_max": float(on_t.max()),
                                      "image": float(row[:, img_pos].sum(-1).mean())})  # fmt: skip
                attn.append({"n_targets": len(cells), "layers": per_layer})
    return preds, attn


def grounding_report(model_path: str | Path | None = None, data_dir: str | Path | None = None, limit: int | None = None,
                     model=None, processor=None) -> dict:  # fmt: skip

    data_dir = Path(data_dir) if data_dir else bundled_data_dir()
    items = load_vqa_items(data_dir, limit)
    if model is None:
        model_path = Path(model_path) if model_path else bundled_model_path()
        model, processor = load_model(model_path, "cpu", attn_implementation="eager")
    preds, attn = first_token_answers(model, processor, items, data_dir, want_attention=True)
    blank_preds, _ = first_token_answers(model, processor, items, data_dir, blank=True)

    by_type: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for it, p, bp in zip(items, preds, blank_preds):
        by_type[it["type"]]["real"].append(float(p == it["answer"]))
        by_type[it["type"]]["blank"].append(float(bp == it["answer"]))
        by_type["all"]["real"].append(float(p == it["answer"]))
        by_type["all"]["blank"].append(float(bp == it["answer"]))
    # the answer prior: always answering the most frequent answer of the type
    prior = {}
    for t in {it["type"] for it in items}:
        answers = Counter(it["answer"] for it in items if it["type"] == t)
        prior[t] = answers.most_common(1)[0][1] / sum(answers.values())
    n_layers = len(attn[0]["layers"]) if attn else 0
    with_targets = [a for a in attn if a["n_targets"]]
    attention = {
        f"layer{i}": {
            "target_mass_mean_over_heads": round(sum(a["layers"][i]["target_mean"] for a in with_targets) / len(with_targets), 3),
            "target_mass_best_head": round(sum(a["layers"][i]["target_max"] for a in with_targets) / len(with_targets), 3),
            "image_mass": round(sum(a["layers"][i]["image"] for a in with_targets) / len(with_targets), 3),
        }
        for i in range(n_layers)
    } if with_targets else {}  # fmt: skip
    uniform = (
        sum(a["n_targets"] / (GRID * GRID) for a in with_targets) / len(with_targets) if with_targets else 0.0
    )
    return {
        "questions": len(items),
        "accuracy": {t: round(sum(v["real"]) / len(v["real"]), 3) for t, v in sorted(by_type.items())},
        "blank_image_accuracy": {
            t: round(sum(v["blank"]) / len(v["blank"]), 3) for t, v in sorted(by_type.items())
        },
        "answer_prior": {t: round(v, 3) for t, v in sorted(prior.items())},
        "attention_on_targets": attention,
        "uniform_share_of_image_mass_on_targets": round(uniform, 3),
    }
