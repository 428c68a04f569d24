"""Helpers of the local lmms-eval task `mm_oval_pope_dev` (the bundled POPE-format dev file, JSONL rows
{question_id, image, text, label, category}). The prompt is lmms-eval's `pope` task's (question +
"\\nAnswer the question using a single word or phrase.", which is also LLaVA's and mm-oval's); the
scoring is lmms-eval's own `pope` functions, called unchanged on the row renamed to their fields."""

import os
from pathlib import Path

from lmms_eval.tasks.pope import utils as pope
from PIL import Image

POST_PROMPT = "\nAnswer the question using a single word or phrase."


def _data_dir() -> Path:
    explicit = os.environ.get("MM_OVAL_LMMS_POPE_DIR")
    if explicit:
        return Path(explicit)
    from mm_oval.zoo import bundled_data_dir

    return Path(bundled_data_dir())


def doc_to_visual(doc):
    with Image.open(_data_dir() / "images" / doc["image"]) as im:
        return [im.convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return pope.pope_doc_to_text({"question": doc["text"]}, {"pre_prompt": "", "post_prompt": POST_PROMPT})


def process_results(doc, results):
    return pope.pope_process_results({**doc, "answer": doc["label"]}, results)


aggregate_accuracy = pope.pope_aggregate_accuracy
aggregate_precision = pope.pope_aggregate_precision
aggregate_recall = pope.pope_aggregate_recall
aggregate_f1_score = pope.pope_aggregate_f1_score
aggregate_yes_ratio = pope.pope_aggregate_yes_ratio
