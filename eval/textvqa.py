"""TextVQA: its JSON layout and accuracy as LLaVA's m4c_evaluator (from MMF) computes it.

The normaliser is `EvalAIAnswerProcessor`, applied to the prediction and to each of the ten human
answers alike: lowercase; drop ',' and '?'; "'s" -> " 's"; newlines/tabs -> spaces; strip; the VQA
punctuation rule (with its own comma regex `(?<=\\d)(\\,)+(?=\\d)`); the same misspelt period regex with
re.UNICODE as count; number words -> digits, articles dropped, contractions expanded. The score of a
prediction is the leave-one-out average of min(1, #matching other answers / 3) over the ten answers,
and the accuracy is the plain mean over questions (no rounding; LLaVA prints it with 2 decimals).
One rule, `m4c`: haotian-liu/LLaVA c121f04, llava/eval/m4c_evaluator.py (`TextVQAAccuracyEvaluator`).
It asserts ten answers per question, so a question with another number of answers (or a non-text
answer) is a DataError naming the file and the entry.

Differences from VQAv2's normaliser (vqa.py): the human answers are always fully normalised (lowercase,
digits, articles), and the prediction also loses ',' '?' and gets "'s" split off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_oval.errors import DataError
from mm_oval.files import atomic_write_json
from mm_oval.prompts import load_image, short_answer_prompt

from .files import read_json
from .tasks import DataOption, Item, Rule, Task, find_one
from .vqa import (  # noqa: F401  (the EvalAI processor is TextVQA's normaliser; re-exported here)
    EVALAI_COMMA_STRIP,
    evalai_normalize,
    evalai_word_tokenize,
    find_image_dir,
    read_vqa_results,
)

TEXTVQA_RULES = (
    Rule(
        "m4c",
        "haotian-liu/LLaVA",
        "c121f0432da27facab705978f83c4ada465e46fd",
        "llava/eval/m4c_evaluator.py",
        "EvalAI answer processor on the prediction and on each of the ten answers; leave-one-out soft score",
    ),
)
NUM_ANSWERS = 10  # TextVQAAccuracyEvaluator asserts len(answers) == 10


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
    title = "TextVQA"
    metric_label = "TextVQA acc"
    primary_metric = "accuracy"
    data_help = "the JSON"
    data_options = (
        DataOption("questions", "questions file (overrides the search in --data)"),
        DataOption(
            "images", "image folder (default: train_images/, images/ or train_val_images/ beside the data)"
        ),
        DataOption("ocr", "Rosetta OCR JSON; adds LLaVA's 'Reference OCR token:' line"),
    )
    predictions_format = 'JSON list [{"question_id", "answer"}]'
    rules = TEXTVQA_RULES

    @staticmethod
    def prompt(question: str, ocr_tokens: list[str] | None = None) -> str:
        """LLaVA-1.5's TextVQA prompt: the question, with OCR tokens (when --ocr is given) the line
        "Reference OCR token: a, b, ...", then the short-answer instruction."""
        if ocr_tokens is not None:
            question += "\nReference OCR token: " + ", ".join(ocr_tokens)
        return short_answer_prompt(question)

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
            if not isinstance(ocr_blob, dict) or not isinstance(ocr_blob.get("data"), list):
                raise DataError(f"{ocr}: expected a JSON object with a 'data' list (the Rosetta OCR layout)")
            for i, e in enumerate(ocr_blob["data"]):
                tokens = e.get("ocr_tokens") if isinstance(e, dict) else None
                if (
                    not isinstance(tokens, list)
                    or not all(isinstance(t, str) for t in tokens)
                    or "image_id" not in e
                ):
                    raise DataError(f"{ocr}, data[{i}]: needs image_id and a list of ocr_tokens (text)")
                ocr_tokens[str(e["image_id"])] = tokens
        items = []
        seen: dict[str, int] = {}
        for i, e in enumerate(blob["data"]):
            if not isinstance(e, dict) or not {"question_id", "question", "image_id", "answers"} <= set(e):
                raise DataError(f"{path}, data[{i}]: needs question_id, question, image_id and answers")
            qid, question, image_id, answers = e["question_id"], e["question"], e["image_id"], e["answers"]
            if isinstance(qid, bool) or not isinstance(qid, (int, str)):
                raise DataError(f"{path}, data[{i}]: question_id {qid!r} is neither a number nor a name")
            if not isinstance(question, str) or isinstance(image_id, (bool, list, dict)) or image_id is None:
                raise DataError(f"{path}, data[{i}]: question must be text and image_id a name or number")
            if (
                not isinstance(answers, list)
                or len(answers) != NUM_ANSWERS
                or not all(isinstance(a, str) for a in answers)
            ):
                got = f"{len(answers)} answers" if isinstance(answers, list) else type(answers).__name__
                raise DataError(
                    f"{path}, data[{i}] (question_id {qid}): needs a list of {NUM_ANSWERS} answers (text), "
                    f"got {got}; the official evaluator (m4c_evaluator.py) asserts ten"
                )
            key = str(qid)
            if key in seen:
                raise DataError(f"{path}, data[{i}]: question_id {qid} repeats data[{seen[key]}]")
            seen[key] = i
            prompt = self.prompt(question, ocr_tokens.get(str(image_id), []) if ocr else None)
            img = image_dir / f"{image_id}.jpg"
            if not img.exists() and (image_dir / f"{image_id}.png").exists():
                img = image_dir / f"{image_id}.png"
            items.append(
                Item(
                    id=str(qid),
                    prompt=prompt,
                    image=(lambda p=img: load_image(p)),
                    meta={"answers": list(answers), "question": question},
                    group=str(image_id),
                )
            )
            if limit is not None and len(items) >= limit:
                break
        return items

    def score(
        self, items: list[Item], predictions: dict[str, str], rules: str | None = None
    ) -> dict[str, Any]:
        rule = self.rule(rules)
        scores = [textvqa_accuracy(predictions.get(it.id, ""), it.meta["answers"]) for it in items]
        return {
            # the evaluator divides by the number of predictions: undefined (None) without questions
            "accuracy": 100.0 * sum(scores) / len(scores) if scores else None,
            "num_questions": len(items),
            "num_missing_predictions": sum(it.id not in predictions for it in items),
            "rules": rule.record(),
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
