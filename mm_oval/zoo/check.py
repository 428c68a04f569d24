"""Grounding check of a tiny LLaVA checkpoint on the bundled VQA-format dev questions, at any geometry.

Three figures, all from the first greedy answer token of the single-turn evaluation prompt:
- accuracy per question type with the real image;
- the same with a blank image (what the model can guess from the text alone: at most the answer prior,
  the share of the type's most frequent answer);
- the attention mass from the answer position on the question's target patches (the patches that hold
  what the answer depends on, as the generator knows them), per layer, against the mass a uniform spread
  over the image would give; overall, and per question type for the best head of each layer and the
  mean over heads. This is the quick evaluator of the zoo; the official scores come from mm_oval.eval.

The geometry comes from the model and the data, never from constants: the patch grid is the vision
config's image_size // patch_size (8x8 for the bundled 64-token model, 24x24 at LLaVA-1.5's 336 px /
patch 14), checked against the `grid` of targets.json's meta when the data has one; a target [row, col]
is image token row * grid + col; the question types are the ones the data holds.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..bundled import resolve_data
from ..errors import DataError, ModelError
from ..prompts import chat_prompt, short_answer_prompt
from . import bundled_data_dir
from .generate import BACKGROUND, image_name

log = logging.getLogger(__name__)

REGEN_HELP = "regenerate the dev sets with `mm-oval zoo generate --out {data_dir}`"


def model_grid(model) -> int:
    """Patches per side of the model's image: the vision config's image_size // patch_size."""
    vision = getattr(model.config, "vision_config", None)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if not isinstance(size, int) or not isinstance(patch, int) or patch <= 0 or size % patch:
        raise ModelError(
            f"the grounding check needs a LLaVA vision config with an image_size that is a multiple of "
            f"patch_size (got image_size={size!r}, patch_size={patch!r}); pass a LLaVA checkpoint as --model"
        )
    return size // patch


def read_targets(data_dir: Path) -> dict:
    """targets.json of a dev-set folder, parsed, with a clear error when it is missing or corrupt."""
    path = data_dir / "targets.json"
    if not path.is_file():
        raise DataError(f"{path} is missing; {REGEN_HELP.format(data_dir=data_dir)}")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); {REGEN_HELP.format(data_dir=data_dir)}") from e
    if not isinstance(data, dict) or not isinstance(data.get("vqav2"), dict):
        raise DataError(f"{path} has no 'vqav2' table of targets; {REGEN_HELP.format(data_dir=data_dir)}")
    return data


def data_grid(targets: dict) -> int | None:
    """The patch grid a dev set was generated for (targets.json's meta `grid`), or None when not stated."""
    grid = (targets.get("meta") or {}).get("grid")
    return grid if isinstance(grid, int) and grid > 0 else None


def bundled_data_for_grid(grid: int) -> Path:
    """The bundled dev-set folder generated at a `grid` x `grid` patch geometry."""
    root = bundled_data_dir().parent
    for d in sorted(p for p in root.iterdir() if (p / "targets.json").is_file()):
        if data_grid(read_targets(d)) == grid:
            return d
    raise DataError(
        f"no bundled dev set under {root} is at a {grid}x{grid} patch grid (the model's geometry); "
        f"pass --data with dev sets generated for this model"
    )


def load_vqa_items(data_dir: Path, limit: int | None = None, grid: int | None = None) -> list[dict]:
    """The dev VQA questions with canonical answer, type and target patches ([row, col]). With `grid`, the
    data's stated grid must match it and every target must lie inside it."""
    qpath = data_dir / "vqav2_dev_questions.json"
    if not qpath.is_file():
        raise DataError(f"{qpath} is missing; {REGEN_HELP.format(data_dir=data_dir)}")
    tpath = data_dir / "targets.json"
    table = read_targets(data_dir)
    stated = data_grid(table)
    if grid is not None and stated is not None and stated != grid:
        raise DataError(
            f"{tpath} is for a {stated}x{stated} patch grid but the model's image is {grid}x{grid} patches; "
            f"pass --data with the dev sets generated at the model's geometry (or the matching --model)"
        )
    questions = json.loads(qpath.read_text())["questions"]
    targets = table["vqav2"]
    items = []
    for i, q in enumerate(questions[:limit] if limit else questions):
        t = targets.get(str(q["question_id"]))
        if t is None:
            raise DataError(f"{tpath}: no entry for question_id {q['question_id']} (row {i} of {qpath})")
        cells = t.get("targets", [])
        side = grid or stated
        for cell in cells:
            ok = (
                isinstance(cell, list) and len(cell) == 2 and all(isinstance(x, int) and x >= 0 for x in cell)
            )
            if not ok or (side is not None and max(cell) >= side):
                raise DataError(
                    f"{tpath}: question_id {q['question_id']} has target {cell!r}; targets are 0-based "
                    f"[row, col] patches" + (f" of a {side}x{side} grid" if side else "")
                    + f"; {REGEN_HELP.format(data_dir=data_dir)}"
                )  # fmt: skip
        items.append({**q, **t})
    return items


def blank_image(model) -> Image.Image:
    """An image with nothing on it, at the model's input size (the background of the 64-token scenes)."""
    size = model.config.vision_config.image_size
    return Image.new("RGB", (size, size), BACKGROUND)


@torch.no_grad()
def first_token_answers(model, processor, items: list[dict], data_dir: Path, blank: bool = False, batch_size: int = 32,
                        want_attention: bool = False) -> tuple[list[str], list[dict]]:  # fmt: skip
    """Greedy first answer word per item and, when asked, per layer the attention of each head from the
    answer position: its mass on the item's targets (`target_heads`) and on the whole image."""
    tok = processor.tokenizer
    image_id = model.config.image_token_id
    grid = model_grid(model)
    preds, attn = [], []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        prompts = [chat_prompt(processor, short_answer_prompt(it["question"])) for it in chunk]
        if blank:
            images = [blank_image(model) for _ in chunk]
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
                if len(img_pos) != grid * grid:
                    raise ModelError(
                        f"the prompt holds {len(img_pos)} image tokens but the model's vision config gives "
                        f"a {grid}x{grid} grid; the check needs one image token per patch (LLaVA's 'default' "
                        f"feature strategy without image newlines)"
                    )
                cells = [img_pos[r * grid + c] for r, c in it["targets"]]
                per_layer = []
                for layer_att in out.attentions:
                    row = layer_att[b, :, -1].float()  # (heads, L)
                    on_t = row[:, cells].sum(-1) if cells else torch.zeros(row.shape[0])
                    per_layer.append({"target_heads": on_t, "image": float(row[:, img_pos].sum(-1).mean())})
                attn.append({"n_targets": len(cells), "layers": per_layer})
    return preds, attn


def answer_prior(items: list[dict]) -> dict[str, float]:
    """Per question type, the accuracy of always giving the type's most frequent answer."""
    prior = {}
    for t in {it["type"] for it in items}:
        answers = Counter(it["answer"] for it in items if it["type"] == t)
        prior[t] = answers.most_common(1)[0][1] / sum(answers.values())
    return prior


def accuracy_by_type(items: list[dict], preds: list[str]) -> dict[str, float]:
    """First-answer accuracy per question type and over all ("all"), unrounded."""
    hits: dict[str, list[float]] = defaultdict(list)
    for it, p in zip(items, preds):
        hits[it["type"]].append(float(p == it["answer"]))
        hits["all"].append(float(p == it["answer"]))
    return {t: sum(v) / len(v) for t, v in hits.items()}


def blank_above_prior(items: list[dict], blank_preds: list[str], sigmas: float = 2.0) -> dict[str, dict]:
    """The question types whose blank-image accuracy exceeds the answer prior by more than `sigmas`
    binomial standard errors of the prior at the type's question count: a model that read the answer from
    the text alone can reach the prior (plus noise), not more. Empty when every type is within the margin.
    A model that scores below the prior with a blank image is not flagged: a blank image truthfully shows
    no objects, so "how many ...?" -> "0" and "is there ...?" -> "no" are the right answers to it."""
    prior, blank = answer_prior(items), accuracy_by_type(items, blank_preds)
    counts = Counter(it["type"] for it in items)
    out = {}
    for t, p in prior.items():
        margin = sigmas * math.sqrt(p * (1 - p) / counts[t])
        if blank[t] > p + margin:
            out[t] = {"blank": blank[t], "prior": p, "margin": margin, "questions": counts[t]}
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _attention_by_type(items: list[dict], attn: list[dict], grid: int) -> dict:
    """Per question type (types with targets only): per layer the mass on the targets averaged over the
    type's questions for each head; the best head's index and mass, and the mean over heads; and the mass
    a uniform spread over the image would put on the targets."""
    by_type: dict[str, list[dict]] = defaultdict(list)
    for it, a in zip(items, attn):
        if a["n_targets"]:
            by_type[it["type"]].append(a)
    out = {}
    for t, rows in sorted(by_type.items()):
        layers = {}
        for i in range(len(rows[0]["layers"])):
            heads = torch.stack([a["layers"][i]["target_heads"] for a in rows]).mean(0)
            best = int(heads.argmax())
            layers[f"layer{i}"] = {
                "best_head": best,
                "best_head_mass": round(float(heads[best]), 3),
                "mean_over_heads": round(float(heads.mean()), 3),
            }
        out[t] = {
            "questions": len(rows),
            "uniform_share": round(_mean([a["n_targets"] / (grid * grid) for a in rows]), 3),
            "layers": layers,
        }
    return out


def grounding_report(
    model: Any, processor: Any, data_dir: str | Path | None = None, limit: int | None = None
) -> dict:
    """The grounding figures of a loaded checkpoint (`mm-oval zoo check` loads it, eager attention) on a dev
    set (default: the bundled dev set at the model's geometry)."""
    grid = model_grid(model)
    if data_dir:
        data_dir = resolve_data(data_dir)
    else:
        data_dir = bundled_data_for_grid(grid)
    items = load_vqa_items(data_dir, limit, grid=grid)
    preds, attn = first_token_answers(model, processor, items, data_dir, want_attention=True)
    blank_preds, _ = first_token_answers(model, processor, items, data_dir, blank=True)

    n_layers = len(attn[0]["layers"]) if attn else 0
    with_targets = [a for a in attn if a["n_targets"]]

    def layer_mean(i: int, figure) -> float:
        return round(sum(figure(a["layers"][i]) for a in with_targets) / len(with_targets), 3)

    attention = {
        f"layer{i}": {
            "target_mass_mean_over_heads": layer_mean(i, lambda lay: float(lay["target_heads"].mean())),
            "target_mass_best_head": layer_mean(i, lambda lay: float(lay["target_heads"].max())),
            "image_mass": layer_mean(i, lambda lay: lay["image"]),
        }
        for i in range(n_layers)
    } if with_targets else {}  # fmt: skip
    uniform = (
        sum(a["n_targets"] / (grid * grid) for a in with_targets) / len(with_targets) if with_targets else 0.0
    )
    return {
        "questions": len(items),
        "grid": grid,
        "accuracy": {t: round(v, 3) for t, v in sorted(accuracy_by_type(items, preds).items())},
        "blank_image_accuracy": {
            t: round(v, 3) for t, v in sorted(accuracy_by_type(items, blank_preds).items())
        },
        "answer_prior": {t: round(v, 3) for t, v in sorted(answer_prior(items).items())},
        "attention_on_targets": attention,
        "uniform_share_of_image_mass_on_targets": round(uniform, 3),
        "attention_on_targets_by_type": _attention_by_type(items, attn, grid),
    }
