"""Readers of the real dataset layouts and of other toolkits' prediction files (no model needed)."""

import json

import pytest
from mm_oval.eval.pope import POPETask
from mm_oval.eval.runner import score_file
from mm_oval.eval.textvqa import TextVQATask
from PIL import Image

from mm_oval.errors import DataError


def test_textvqa_layout_with_llava_ocr_prompt(tmp_path):
    (tmp_path / "train_images").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "train_images" / "abc123.jpg")
    blob = {
        "dataset_name": "textvqa",
        "data": [
            {
                "question_id": 7,
                "question": "what brand is this?",
                "image_id": "abc123",
                "answers": ["Nikon"] * 9 + ["nikon."],
            },
        ],
    }
    (tmp_path / "TextVQA_0.5.1_val.json").write_text(json.dumps(blob))
    ocr = {"data": [{"image_id": "abc123", "ocr_tokens": ["NIKON", "D50"]}]}
    (tmp_path / "ocr.json").write_text(json.dumps(ocr))
    items = TextVQATask().load(tmp_path, ocr=str(tmp_path / "ocr.json"))
    assert items[0].prompt == (
        "what brand is this?\nReference OCR token: NIKON, D50\nAnswer the question using a single word or phrase."
    )
    assert items[0].image().size == (32, 32)
    (tmp_path / "preds.json").write_text(json.dumps([{"question_id": 7, "answer": "NIKON"}]))
    res = score_file("textvqa", tmp_path / "TextVQA_0.5.1_val.json", tmp_path / "preds.json")
    assert res["scores"]["accuracy"] == 100.0


def test_pope_official_folder_layout_and_llava_answers_file(tmp_path):
    for cat, labels in (("random", ["yes", "no"]), ("adversarial", ["yes", "yes"])):
        rows = [
            {
                "question_id": i + 1,
                "image": "COCO_val2014_000000000001.jpg",
                "text": "Is there a dog in the image?",
                "label": lab,
            }
            for i, lab in enumerate(labels)
        ]
        (tmp_path / f"coco_pope_{cat}.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = POPETask().load(tmp_path)
    assert sorted(it.id for it in items) == ["adversarial/1", "adversarial/2", "random/1", "random/2"]
    assert items[0].prompt.endswith("\nAnswer the question using a single word or phrase.")
    answers = [
        {"question_id": 1, "category": "random", "text": "Yes"},
        {"question_id": 2, "category": "random", "text": "No, there is not."},
        {"question_id": 1, "category": "adversarial", "text": "Yes, there is."},
        {"question_id": 2, "category": "adversarial", "text": "No"},
    ]
    (tmp_path / "answers.jsonl").write_text("\n".join(json.dumps(a) for a in answers) + "\n")
    res = score_file("pope", tmp_path, tmp_path / "answers.jsonl")
    s = res["scores"]
    assert s["per_category"]["random"]["accuracy"] == 100.0
    assert s["per_category"]["adversarial"]["accuracy"] == 50.0
    assert s["mean_over_categories"]["accuracy"] == 75.0


def test_corrupt_jsonl_row_is_named(tmp_path):
    (tmp_path / "pope.jsonl").write_text(
        '{"question_id": 1, "image": "a.png", "text": "q", "label": "yes"}\n{oops\n'
    )
    with pytest.raises(DataError, match="line 2"):
        POPETask().load(tmp_path / "pope.jsonl")
    (tmp_path / "pope.jsonl").write_text(
        '{"question_id": 1, "image": "a.png", "text": "q", "label": "maybe"}\n'
    )
    with pytest.raises(DataError, match="line 1: label 'maybe'"):
        POPETask().load(tmp_path / "pope.jsonl")


def test_mmbench_predictions_from_xlsx(tmp_path):
    from mm_oval.eval.mmbench import MMBenchTask
    from openpyxl import Workbook

    wb = Workbook()
    ws = wb.active
    ws.append(["index", "question", "prediction"])
    ws.append([0, "q", "B"])
    ws.append([1000000, "q", "(A)"])
    wb.save(tmp_path / "preds.xlsx")
    preds = MMBenchTask().read_predictions(tmp_path / "preds.xlsx", [])
    assert preds == {"0": "B", "1000000": "(A)"}
