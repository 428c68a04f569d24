"""POPE (object hallucination): yes/no questions scored as LLaVA's `eval_pope.py` does.

- Data: JSONL rows {question_id, image, text, label, category?}; or a folder of the official
  `coco_pope_<category>.json` files (JSONL, labels inside), where ids are "<category>/<question_id>".
- Prompt: the question + "\\nAnswer the question using a single word or phrase." (added unless present).
- Extraction: keep the text before the first '.', drop ',', split on single spaces; "no" when one of the
  words is exactly "No", "not" or "no", else "yes" (so "NO" and "Nope" read as yes, as in the script).
- Metrics per category (positive = yes): accuracy, precision, recall, F1, yes-ratio; papers report the
  mean over the categories (random / popular / adversarial), given here as `mean_over_categories`.
- One rule, `llava`: haotian-liu/LLaVA c121f04, llava/eval/eval_pope.py.
- A question without an answer counts as answered wrongly (the opposite of its label: a false negative
  for a yes question, a false positive for a no question), never as "yes"; `num_missing_predictions`
  says how many. A predictions file that answers none of the questions is an error.
- Where the script would divide by zero (no yes predictions: precision; no yes labels: recall;
  precision + recall = 0: F1; no questions: accuracy and yes-ratio) the value is None and `undefined`
  says which and why, instead of a 0 that reads like a measurement.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from mm_oval.errors import DataError
from mm_oval.files import atomic_write_text
from mm_oval.prompts import SHORT_ANSWER_PROMPT, load_image, short_answer_prompt

from .files import read_jsonl_answers, read_jsonl_lines
from .tasks import BUNDLED_SETS, DataOption, Item, Rule, Task
from .vqa import find_image_dir


def yes_no(text: str) -> str:
    """LLaVA's eval_pope rule: 'yes' or 'no'."""
    if text.find(".") != -1:
        text = text.split(".")[0]
    text = text.replace(",", "")
    words = text.split(" ")
    if "No" in words or "not" in words or "no" in words:
        return "no"
    return "yes"


POPE_RULES = (
    Rule(
        "llava",
        "haotian-liu/LLaVA",
        "c121f0432da27facab705978f83c4ada465e46fd",
        "llava/eval/eval_pope.py",
        "yes unless the first sentence has the word No/no/not; precision, recall, F1 with yes positive",
    ),
)
METRICS = ("accuracy", "precision", "recall", "f1", "yes_ratio")


def binary_metrics(preds: list[int], labels: list[int]) -> dict[str, Any]:
    """eval_pope's figures (in percent); a ratio the script would divide by zero for is None, and
    `undefined` names it."""
    tp = sum(1 for p, g in zip(preds, labels) if p == 1 and g == 1)
    fp = sum(1 for p, g in zip(preds, labels) if p == 1 and g == 0)
    tn = sum(1 for p, g in zip(preds, labels) if p == 0 and g == 0)
    fn = sum(1 for p, g in zip(preds, labels) if p == 0 and g == 1)
    n = len(preds)
    undefined: list[str] = []

    def ratio(num: float, den: float, name: str, why: str) -> float | None:
        if den:
            return num / den
        undefined.append(f"{name}: {why}")
        return None

    precision = ratio(tp, tp + fp, "precision", "no question was answered yes (TP + FP = 0)")
    recall = ratio(tp, tp + fn, "recall", "no question has the label yes (TP + FN = 0)")
    if precision is None or recall is None:
        f1 = None
        undefined.append("f1: precision or recall is undefined")
    else:
        f1 = ratio(2 * precision * recall, precision + recall, "f1", "precision + recall = 0 (TP = 0)")
    accuracy = ratio(tp + tn, n, "accuracy", "no questions")
    yes_ratio = ratio(sum(preds), n, "yes_ratio", "no questions")

    def pct(x: float | None) -> float | None:
        return None if x is None else 100.0 * x

    out: dict[str, Any] = {
        "accuracy": pct(accuracy), "precision": pct(precision), "recall": pct(recall), "f1": pct(f1),
        "yes_ratio": pct(yes_ratio), "TP": tp, "FP": fp, "TN": tn, "FN": fn, "count": n,
    }  # fmt: skip
    if undefined:
        out["undefined"] = undefined
    return out


class POPETask(Task):
    name = "pope"
    title = "POPE"
    metric_label = "POPE F1"
    primary_metric = "f1"
    data_help = "the JSONL or a folder of coco_pope_<category>.json"
    data_options = (DataOption("images", "image folder (default: images/ or val2014/ beside the data)"),)
    bundled = BUNDLED_SETS
    predictions_format = 'JSONL rows {"question_id", "text"} (LLaVA\'s answers file)'
    rules = POPE_RULES

    @staticmethod
    def prompt(text: str) -> str:
        """LLaVA-1.5's short-answer prompt, unless the file's question already carries the instruction."""
        return text if SHORT_ANSWER_PROMPT in text else short_answer_prompt(text)

    def load(self, data: Path, limit: int | None = None, images: str | None = None, **_: Any) -> list[Item]:
        if data.is_file():
            sources = [(data, None)]
        else:
            official = sorted(data.glob("coco_pope_*.json"))
            if official:
                sources = [(p, p.stem[len("coco_pope_") :]) for p in official]
            else:
                hits = sorted(data.glob("pope*.jsonl")) or sorted(data.glob("*.jsonl"))
                if len(hits) != 1:
                    raise DataError(
                        f"{data}: expected one POPE .jsonl file or coco_pope_<category>.json files"
                    )
                sources = [(hits[0], None)]
        image_dir = find_image_dir(data, images, ("images", "val2014"))
        items: list[Item] = []
        for path, file_category in sources:
            for lineno, row in read_jsonl_lines(path, "POPE file"):
                try:
                    qid, text, label, image = row["question_id"], row["text"], row["label"], row["image"]
                except KeyError as e:
                    raise DataError(
                        f"{path}, line {lineno}: missing field {e} (need question_id, image, text, label)"
                    ) from e
                if not isinstance(text, str) or not isinstance(image, str):
                    raise DataError(f"{path}, line {lineno}: text and image must be text")
                if isinstance(qid, (bool, list, dict)) or qid is None:
                    raise DataError(
                        f"{path}, line {lineno}: question_id {qid!r} is neither a number nor a name"
                    )
                if str(label).lower() not in ("yes", "no"):
                    raise DataError(f"{path}, line {lineno}: label {label!r} is not 'yes' or 'no'")
                category = file_category or row.get("category") or "all"
                if not isinstance(category, str):
                    raise DataError(f"{path}, line {lineno}: category {category!r} is not text")
                prompt = self.prompt(text)
                img = image_dir / image
                items.append(
                    Item(
                        id=f"{file_category}/{qid}" if file_category else str(qid),
                        prompt=prompt,
                        image=(lambda p=img: load_image(p)),
                        meta={"label": str(label).lower(), "category": category, "question_id": qid},
                        group=str(image),
                    )
                )
        if limit is not None:
            items = items[:limit]
        ids = [it.id for it in items]
        if len(set(ids)) != len(ids):
            raise DataError(f"{data}: question_id values repeat; POPE ids must be unique within a file")
        return items

    def score(
        self, items: list[Item], predictions: dict[str, str], rules: str | None = None
    ) -> dict[str, Any]:
        rule = self.rule(rules)
        by_cat: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        all_p, all_l = [], []
        for it in items:
            g = 0 if it.meta["label"] == "no" else 1
            text = predictions.get(it.id)
            # no answer: wrong, whatever the label (an empty answer would read as "yes")
            p = 1 - g if text is None else (0 if yes_no(text) == "no" else 1)
            by_cat[it.meta["category"]][0].append(p)
            by_cat[it.meta["category"]][1].append(g)
            all_p.append(p)
            all_l.append(g)
        out: dict[str, Any] = binary_metrics(all_p, all_l)
        per = {c: binary_metrics(p, g) for c, (p, g) in sorted(by_cat.items())}
        out["per_category"] = per
        mean: dict[str, float | None] = {}
        for k in METRICS:
            vals = [m[k] for m in per.values()]
            mean[k] = sum(vals) / len(vals) if vals and None not in vals else None
        out["mean_over_categories"] = mean
        out["num_missing_predictions"] = sum(it.id not in predictions for it in items)
        out["rules"] = rule.record()
        return out

    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        ids = {it.id for it in items}

        def key(r: dict, where: str) -> str:  # an id of the category folder is '<category>/<question_id>'
            k = str(r["question_id"])
            return f"{r['category']}/{k}" if k not in ids and "category" in r else k

        out, n = read_jsonl_answers(path, ids, "POPE answers file", key)
        if not out and items:
            folder = any("/" in i for i in ids)
            raise DataError(
                f"{path}: none of its {n} answers names a question in the data"
                + (
                    " (with the coco_pope_<category>.json folder the ids are '<category>/<question_id>': give "
                    'each answer the "category" of its question, as LLaVA\'s question file has it)'
                    if folder
                    else "; are these answers for another question file?"
                )
            )
        return out

    def write_predictions(self, path: Path, items: list[Item], predictions: dict[str, str]) -> Path:
        path = path.with_suffix(".jsonl")
        lines = [
            json.dumps(
                {"question_id": it.id, "text": predictions.get(it.id, ""), "category": it.meta["category"]}
            )
            for it in items
        ]
        atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""))
        return path
