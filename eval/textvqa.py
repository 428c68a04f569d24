"""TextVQA: its JSON layout and accuracy as LLaVA's m4c_evaluator (from MMF) computes it.

The normaliser is `EvalAIAnswerProcessor`, applied to the prediction and to each of the ten human
answers alike: lowercase; drop ',' and '?'; "'s" -> " 's"; newlines/tabs -> spaces; strip; the VQA
punctuation rule (with its own comma regex `(?<=\\d)(\\,)+(?=\\d)`); the same misspelt period regex with
re.UNICODE as count; number words -> digits, articles dropped, contractions expanded. The score of a
prediction is the leave-one-out average of min(1, #matching other answers / 3) over the ten answers,
and the accuracy is the plain mean over questions (no rounding; LLaVA prints it with 2 decimals).

Differences from VQAv2's normaliser (vqa.py): the human answers are always fully normalised (lowercase,
digits, articles), and the prediction also loses ',' '?' and gets "'s" split off.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import DataError
from .files import atomic_write_json, open_image, read_json
from .tasks import SHORT_ANSWER_PROMPT, Item, Task, find_one
from .vqa import find_image_dir, process_digit_article, process_punctuation, read_vqa_results

# EvalAIAnswerProcessor's tables equal vqaEval.py's master tables (checked entry by entry);
# only the comma regex differs
EVALAI_COMMA_STRIP = re.compile(r"(?<=\d)(\,)+(?=\d)")


def evalai_word_tokenize(word: str) -> str:
    word = word.lower()
    word = word.replace(",", "").replace("?", "").replace("'s", " 's")
    return word.strip()


def evalai_normalize(item: str) -> str:
    """`EvalAIAnswerProcessor.__call__`."""
    item = evalai_word_tokenize(item)
    item = item.replace("\n", " ").replace("\t", " ").strip()
    item = process_punctuation(item, EVALAI_COMMA_STRIP)
    return process_digit_article(item)


def textvqa_accuracy(prediction: str, raw_answers: list[str]) -> float:
    """`TextVQAAccuracyEvaluator`: the prediction's leave-one-out soft score among the human answers."""
    answers = [evalai_normalize(a) for a in raw_answers]
    pred = evalai_normalize(prediction)
    if pred not in set(answers):
        return 0.0
    gt = list(enumerate(answers))
    accs = []
    for left_out in gt:
        matching = [x for x in gt if x != left_out and x[1] == pred]
        accs.append(min(1, float(len(matching)) / 3))
    return sum(accs) / len(accs)


class TextVQATask(Task):
    name = "textvqa"
    primary_metric = "accuracy"
    predictions_format = 'JSON list [{"question_id", "answer"}]'

    def load(
        self,
        data: Path,
        limit: int | None = None,
        questions: str | None = None,
        images: str | None = None,
        ocr: str | None = None,
        **_: Any,
    ) -> list[Item]:
        path = (
            Path(questions)
            if questions
            else (
                data
                if data.is_file()
                else find_one(data, ["TextVQA*val*.json", "*textvqa*.json", "*.json"], "TextVQA")
            )
        )
        image_dir = find_image_dir(data, images, ("train_images", "images", "train_val_images"))
        blob = read_json(path, "TextVQA file")
        if not isinstance(blob, dict) or not isinstance(blob.get("data"), list):
            raise DataError(f"{path}: expected a JSON object with a 'data' list (the TextVQA layout)")
        ocr_tokens: dict[str, list[str]] = {}
        if ocr:
            ocr_blob = read_json(ocr, "OCR file")
            for i, e in enumerate(ocr_blob.get("data", []) if isinstance(ocr_blob, dict) else []):
                try:
                    ocr_tokens[str(e["image_id"])] = list(e["ocr_tokens"])
                except (KeyError, TypeError) as err:
                    raise DataError(f"{ocr}, data[{i}]: needs image_id and ocr_tokens") from err
        items = []
        for i, e in enumerate(blob["data"]):
            try:
                qid, question, image_id, answers = (
                    e["question_id"],
                    e["question"],
                    e["image_id"],
                    e["answers"],
                )
            except (KeyError, TypeError) as err:
                raise DataError(
                    f"{path}, data[{i}]: needs question_id, question, image_id and answers ({err})"
                ) from err
            if not isinstance(answers, list) or not answers:
                raise DataError(f"{path}, data[{i}]: 'answers' must be a non-empty list of strings")
            prompt = question
            if ocr:
                # LLaVA-1.5's TextVQA prompt with OCR tokens
                prompt += "\nReference OCR token: " + ", ".join(ocr_tokens.get(str(image_id), []))
            prompt += "\n" + SHORT_ANSWER_PROMPT
            img = image_dir / f"{image_id}.jpg"
            if not img.exists() and (image_dir / f"{image_id}.png").exists():
                img = image_dir / f"{image_id}.png"
            items.append(
                Item(
                    id=str(qid),
                    prompt=prompt,
                    image=(lambda p=img: open_image(p)),
                    meta={"answers": [str(a) for a in answers], "question": question},
                    group=str(image_id),
                )
            )
            if limit is not None and len(items) >= limit:
                break
        return items

    def score(self, items: list[Item], predictions: dict[str, str]) -> dict[str, Any]:
        scores = [textvqa_accuracy(predictions.get(it.id, ""), it.meta["answers"]) for it in items]
        acc = sum(scores) / len(scores) if scores else 0.0
        return {
            "accuracy": 100.0 * acc,
            "num_questions": len(items),
            "num_missing_predictions": sum(it.id not in predictions for it in items),
        }

    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        return read_vqa_results(path)

    def write_predictions(self, path: Path, items: list[Item], predictions: dict[str, str]) -> Path:
        path = path.with_suffix(".json")
        atomic_write_json(
            path,
            [
                {
                    "question_id": int(it.id) if it.id.isdigit() else it.id,
                    "answer": predictions.get(it.id, ""),
                }
                for it in items
            ],
        )
        return path
