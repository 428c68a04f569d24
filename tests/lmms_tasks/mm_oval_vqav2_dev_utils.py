"""Helpers of the local lmms-eval task `mm_oval_vqav2_dev` (the bundled VQAv2-format dev files).

The questions file is the dataset (`load_dataset("json", field="questions")`); images and human answers
are read from the same folder, by image_id and question_id, as the official VQA tools do."""

import json
import os
from functools import lru_cache
from pathlib import Path

from mm_oval.eval.vqa import coco_image_path, vqa_accuracy
from PIL import Image

POST_PROMPT = "\nAnswer the question using a single word or phrase."


def _data_dir() -> Path:
    explicit = os.environ.get("MM_OVAL_LMMS_VQA_DIR")
    if explicit:
        return Path(explicit)
    from mm_oval.zoo import bundled_data_dir

    return Path(bundled_data_dir())


@lru_cache(maxsize=1)
def _answers() -> dict:
    folder = _data_dir()
    path = next(iter(sorted(folder.glob("*annotations*.json"))))
    anns = json.loads(path.read_text())["annotations"]
    return {int(a["question_id"]): a["answers"] for a in anns}


def doc_to_visual(doc):
    path = coco_image_path(_data_dir() / "images", doc["image_id"])
    with Image.open(path) as im:
        return [im.convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return f"{doc['question']}{POST_PROMPT}"


def process_results(doc, results):
    return {"vqa_accuracy": vqa_accuracy(results[0], _answers()[int(doc["question_id"])], "lmms-eval")}
