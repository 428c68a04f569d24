"""Object lists: "what are the objects from left to right ?" answered by a list such as
"red circle, blue square, green cross", scored item by item.

- Data: `list_dev.jsonl` (or the JSONL file itself), rows {question_id (int), image, question, answer
  (a non-empty list of item texts), order ("left to right" | "top to bottom")}; images under images/
  beside it (or --images). Every row is checked when the file is read; a bad one is a DataError naming
  the file and the line.
- Prompt: the question + "\\n" + LIST_INSTRUCTION ("List each object by its color and shape, separated
  by commas."), inside the model's chat template like the other tasks.
- One rule, `objlist-v1` (mm-oval object list v1), defined by this project (no official script exists):
  split the prediction on commas, and on the word "and" standing between items; normalise each item
  (lowercase, collapse whitespace, strip surrounding whitespace and `. ! ;`, drop one leading article
  a/an/the); drop empty items. References are normalised the same way. Per question, with `matched` the
  multiset intersection: precision = matched / predicted (0 for an empty prediction), recall = matched /
  reference, F1 = 2PR / (P + R) (0 when either is 0), exact order = 1 when the normalised lists are
  equal, order score = LCS(prediction, reference) / reference length. Reported as round(100 * mean, 2)
  overall and per `order`; F1 is the primary score.
- A question without a prediction scores 0 on every metric; `num_missing_predictions` says how many.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from mm_oval.errors import DataError
from mm_oval.prompts import list_prompt, load_image
from mm_oval.zoo import bundled576_data_dir

from .files import read_jsonl_answers, read_jsonl_lines, write_jsonl_answers
from .tasks import DataOption, Item, Rule, Task, find_one
from .vqa import find_image_dir

OBJLIST_RULES = (
    Rule(
        "objlist-v1",
        "mm-oval",
        "v1",
        "eval/objlist.py",
        "mm-oval object list v1: items split on commas and a standalone 'and', lowercased, stripped of "
        "whitespace and . ! ;, a leading a/an/the dropped; per question multiset precision, recall, F1, "
        "exact order and LCS order score; means x100",
    ),
)
ORDERS = ("left to right", "top to bottom")
METRICS = ("f1", "precision", "recall", "exact_order", "order_score")
FIELDS = ("question_id", "image", "question", "answer", "order")
ARTICLES = ("a", "an", "the")
# what is stripped from both ends of an item (whitespace and the marks `. ! ;`)
_STRIP = " \t\n\r\f\v.!;"
# the word "and" between items: delimited by whitespace or the ends, any case ("black-and-white" stays)
_AND = re.compile(r"(?<!\S)and(?!\S)", re.IGNORECASE)


def normalize_item(text: str) -> str:
    """One item under the rule: lowercase, whitespace collapsed, `. ! ;` and whitespace stripped from
    both ends, one leading article (a, an, the followed by a word) dropped."""
    text = " ".join(text.lower().split()).strip(_STRIP)
    head, _, rest = text.partition(" ")
    if head in ARTICLES and rest:
        text = rest.strip(_STRIP)
    return text


def split_items(text: str) -> list[str]:
    """The normalised, non-empty items of a list answer: split on commas, then on a standalone "and"."""
    pieces = [p for part in text.split(",") for p in _AND.split(part)]
    return [item for item in map(normalize_item, pieces) if item]


def lcs_length(a: list[str], b: list[str]) -> int:
    """The length of the longest common subsequence of `a` and `b`."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def list_scores(predicted: list[str], reference: list[str]) -> dict[str, float]:
    """The rule's per-question figures (fractions in [0, 1]) of normalised item lists; `reference` is
    non-empty (the loader makes sure)."""
    matched = sum((Counter(predicted) & Counter(reference)).values())
    precision = matched / len(predicted) if predicted else 0.0
    recall = matched / len(reference)
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else 0.0
    return {
        "f1": f1,
        "precision": precision,
        "recall": recall,
        "exact_order": float(predicted == reference),
        "order_score": lcs_length(predicted, reference) / len(reference),
    }


def score_prediction(prediction: str | None, reference: list[str]) -> dict[str, float]:
    """A prediction text (None: no prediction) against the reference items, both under the rule."""
    ref = [normalize_item(r) for r in reference]
    return list_scores([] if prediction is None else split_items(prediction), ref)


def _means(rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: round(100 * sum(r[k] for r in rows) / len(rows), 2) for k in METRICS}
    out["count"] = len(rows)
    return out


def _check_row(row: dict, where: str) -> None:
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise DataError(
            f"{where}: missing field {', '.join(map(repr, missing))}; each row needs {', '.join(FIELDS)}"
        )
    qid = row["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, int):
        raise DataError(
            f"{where}: question_id {qid!r} is not an integer; give each question a whole-number id"
        )
    for key in ("image", "question"):
        if not isinstance(row[key], str) or not row[key].strip():
            raise DataError(f"{where}: {key} {row[key]!r} is not a non-empty text")
    answer = row["answer"]
    if not isinstance(answer, list) or not answer:
        raise DataError(
            f"{where}: answer {answer!r} is not a non-empty list; write the objects as a list of texts, "
            'e.g. ["red circle", "blue square"]'
        )
    for item in answer:
        if not isinstance(item, str):
            raise DataError(f"{where}: answer item {item!r} is not text; each item is one object's name")
        if split_items(item) != [normalize_item(item)]:
            raise DataError(
                f"{where}: answer item {item!r} is empty or would be split by the scoring rule (a comma or "
                "the word 'and' separates items); write each object as its own item"
            )
    if row["order"] not in ORDERS:
        raise DataError(f"{where}: order {row['order']!r} is not one of {', '.join(map(repr, ORDERS))}")


class ObjListTask(Task):
    name = "objlist"
    title = "objlist"
    metric_label = "object list F1"
    # a list of several objects: ~2-3 tokens per item plus separators; greedy decoding stops at EOS
    max_new_tokens = 48
    primary_metric = "f1"
    data_help = "list_dev.jsonl or its folder"
    data_options = (DataOption("images", "image folder (default: images/ beside the data)"),)
    bundled = {"bundled576": bundled576_data_dir}  # the 64-token benchmark has no object lists
    predictions_format = 'JSONL rows {"question_id", "text"} (LLaVA\'s answers file)'
    rules = OBJLIST_RULES
    # the question, then "List each object by its color and shape, separated by commas."
    prompt = staticmethod(list_prompt)

    def load(self, data: Path, limit: int | None = None, images: str | None = None, **_: Any) -> list[Item]:
        path = data if data.is_file() else find_one(data, ["list_dev.jsonl", "list*.jsonl"], "object-list")
        image_dir = find_image_dir(data, images, ("images",))
        rows = read_jsonl_lines(path, "object-list file")
        if not rows:
            raise DataError(f"object-list file {path} holds no questions; write one JSON row per question")
        seen: dict[int, int] = {}
        items: list[Item] = []
        for lineno, row in rows:
            where = f"{path}, line {lineno}"
            _check_row(row, where)
            qid = row["question_id"]
            if qid in seen:
                raise DataError(
                    f"{where}: question_id {qid} repeats line {seen[qid]}; each question needs its own id"
                )
            seen[qid] = lineno
            img = image_dir / row["image"]
            if not img.is_file():
                raise DataError(
                    f"{where}: image {img} not found; put the images in {image_dir} or pass --images DIR"
                )
            items.append(
                Item(
                    id=str(qid),
                    prompt=self.prompt(row["question"]),
                    image=(lambda p=img: load_image(p)),
                    meta={"question_id": qid, "answer": list(row["answer"]), "order": row["order"]},
                    group=row["image"],
                )
            )
        return items if limit is None else items[:limit]

    def score(
        self, items: list[Item], predictions: dict[str, str], rules: str | None = None
    ) -> dict[str, Any]:
        rule = self.rule(rules)
        rows: list[dict[str, float]] = []
        by_order: dict[str, list[dict[str, float]]] = defaultdict(list)
        for it in items:
            row = score_prediction(predictions.get(it.id), it.meta["answer"])
            rows.append(row)
            by_order[it.meta["order"]].append(row)
        if rows:
            out: dict[str, Any] = _means(rows)
        else:
            out = {**dict.fromkeys(METRICS), "count": 0, "undefined": ["every metric: no questions"]}
        out["by_order"] = {o: _means(r) for o, r in sorted(by_order.items())}
        out["num_missing_predictions"] = sum(it.id not in predictions for it in items)
        out["rules"] = rule.record()
        return out

    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        def key(r: dict, where: str) -> str:
            qid = r["question_id"]
            if isinstance(qid, (bool, list, dict)) or qid is None:
                raise DataError(f"{where}: question_id {qid!r} is not a question id")
            return str(qid)

        out, n = read_jsonl_answers(path, {it.id for it in items}, "object-list answers file", key)
        if not out and items:
            raise DataError(
                f"{path}: none of its {n} answers names a question in the data; are these answers "
                "for another question file?"
            )
        return out

    def write_predictions(self, path: Path, items: list[Item], predictions: dict[str, str]) -> Path:
        return write_jsonl_answers(
            path, ((it.meta["question_id"], predictions[it.id]) for it in items if it.id in predictions)
        )
