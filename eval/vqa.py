"""VQAv2: data loading and accuracy exactly as the challenge's own evaluation script computes it.

The normaliser reproduces `PythonEvaluationTools/vqaEvaluation/vqaEval.py` of the VQA repository
(GT-Vision-Lab/VQA, master, the Python 3 revision c4e6a0e) line by line, quirks included:

- the prediction: newlines/tabs -> spaces, strip, `processPunctuation`, then `processDigitArticle`;
- `processPunctuation`: for each character of its 21-entry list, delete it when the *original* text has
  it next to a space or contains a digit-comma-digit, else replace it by a space; then the period regex
  `(?!<=\\d)(\\.)(?!\\d)` - its look-behind is misspelt as a look-ahead, so every '.' not followed by a
  digit goes - applied with `re.UNICODE` passed as the *count* (at most 32 periods removed);
  `'` and `:` are not in the list;
- `processDigitArticle`: lowercase, split on whitespace, number words zero..ten (and 'none') -> digits,
  drop a/an/the, expand the contractions map (apostrophe-less keys -> "don't" etc.);
- the ten human answers get `processPunctuation` only, and only when they are not all identical
  (so they are never lowercased, and ten identical "hot-dog" match no prediction);
- leave-one-out: each of the ten answers is left out in turn (the script compares the answer dicts),
  the prediction scores min(1, #matching others / 3), and the ten scores are averaged;
- overall / per question type / per answer type: round(100 * mean, 2).

An earlier (Python 2) revision of the script used a different punctuation list (with ':' and "'"
and without '-', '!', '{', '}') and curly apostrophes in some contraction values; the master revision
above is what is reproduced here. TextVQA uses another normaliser (see textvqa.py).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import DataError
from .files import atomic_write_json, open_image, read_json
from .tasks import SHORT_ANSWER_PROMPT, Item, Task, find_one

log = logging.getLogger(__name__)

CONTRACTIONS: dict[str, str] = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm",
    "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll",
    "let's": "let's", "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've",
    "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're",
    "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll",
    "whyre": "why're", "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}  # fmt: skip

MANUAL_MAP: dict[str, str] = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip
ARTICLES = ["a", "an", "the"]
# the look-behind is spelt "(?!<=" in the original: a negative look-ahead for "<=", always true before "."
PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
COMMA_STRIP = re.compile(r"(\d)(\,)(\d)")
PUNCT = [
    ";",
    r"/",
    "[",
    "]",
    '"',
    "{",
    "}",
    "(",
    ")",
    "=",
    "+",
    "\\",
    "_",
    "-",
    ">",
    "<",
    "@",
    "`",
    ",",
    "?",
    "!",
]


def process_punctuation(in_text: str, comma_strip: re.Pattern = COMMA_STRIP) -> str:
    """`VQAEval.processPunctuation` (EvalAI's processor is the same with its own comma regex)."""
    out_text = in_text
    for p in PUNCT:
        if (p + " " in in_text or " " + p in in_text) or (re.search(comma_strip, in_text) is not None):
            out_text = out_text.replace(p, "")
        else:
            out_text = out_text.replace(p, " ")
    # the original passes re.UNICODE (== 32) positionally, i.e. as `count`
    out_text = PERIOD_STRIP.sub("", out_text, int(re.UNICODE))
    return out_text


def process_digit_article(in_text: str) -> str:
    """`VQAEval.processDigitArticle`."""
    out_text = []
    for word in in_text.lower().split():
        word = MANUAL_MAP.get(word, word)
        if word not in ARTICLES:
            out_text.append(word)
    for word_id, word in enumerate(out_text):
        if word in CONTRACTIONS:
            out_text[word_id] = CONTRACTIONS[word]
    return " ".join(out_text)


def normalize_prediction(answer: str) -> str:
    """What `VQAEval.evaluate` does to a predicted answer before matching."""
    answer = answer.replace("\n", " ").replace("\t", " ").strip()
    return process_digit_article(process_punctuation(answer))


def normalize_ground_truth(answers: list[str]) -> list[str]:
    """What `VQAEval.evaluate` does to the ten human answers: punctuation only, and only when they differ."""
    if len(set(answers)) > 1:
        return [process_punctuation(a) for a in answers]
    return list(answers)


def vqa_accuracy(prediction: str, gt_answers: list[dict] | list[str]) -> float:
    """Accuracy of one prediction (0..1, unrounded) against the human answers of one question.

    `gt_answers` are the annotation's answer dicts ({answer, answer_confidence, answer_id}) or plain
    strings. As in the script, "leaving one out" removes every entry equal to the left-out one (with
    real annotations the answer ids make each entry unique)."""
    dicts = [dict(a) if isinstance(a, dict) else {"answer": a, "_pos": i} for i, a in enumerate(gt_answers)]
    if not dicts:
        raise DataError("a VQA question has no human answers")
    processed = normalize_ground_truth([d["answer"] for d in dicts])
    for d, a in zip(dicts, processed):
        d["answer"] = a
    res = normalize_prediction(prediction)
    accs = []
    for left_out in dicts:
        others = [d for d in dicts if d != left_out]
        matching = [d for d in others if d["answer"] == res]
        accs.append(min(1, float(len(matching)) / 3))
    return float(sum(accs)) / len(accs)


def aggregate(rows: list[tuple[float, str | None, str | None]], n: int = 2) -> dict[str, Any]:
    """`VQAEval.setAccuracy`: rows are (accuracy, question_type, answer_type) in evaluation order."""
    if not rows:
        return {"overall": 0.0, "perQuestionType": {}, "perAnswerType": {}}
    by_q: dict[str, list[float]] = defaultdict(list)
    by_a: dict[str, list[float]] = defaultdict(list)
    for acc, qt, at in rows:
        if qt is not None:
            by_q[qt].append(acc)
        if at is not None:
            by_a[at].append(acc)
    accs = [r[0] for r in rows]
    return {
        "overall": round(100 * float(sum(accs)) / len(accs), n),
        "perQuestionType": {k: round(100 * float(sum(v)) / len(v), n) for k, v in by_q.items()},
        "perAnswerType": {k: round(100 * float(sum(v)) / len(v), n) for k, v in by_a.items()},
    }


def coco_image_path(images: Path, image_id: int | str, mapping: dict | None = None) -> Path:
    """Where a COCO-style image lives: a mapping entry, else COCO_val2014_%012d.{jpg,png}, else <id>.{jpg,png}."""
    if mapping is not None:
        name = mapping.get(str(image_id))
        if name is None:
            raise DataError(f"image id {image_id} is not in the image mapping")
        return images / name
    candidates = []
    if isinstance(image_id, int) or str(image_id).isdigit():
        iid = int(image_id)
        for prefix in ("COCO_val2014_", "COCO_test2015_", "COCO_train2014_"):
            candidates += [images / f"{prefix}{iid:012d}.jpg", images / f"{prefix}{iid:012d}.png"]
    candidates += [images / f"{image_id}.jpg", images / f"{image_id}.png"]
    for c in candidates:
        if c.is_file():
            return c
    return candidates[0]


def find_image_dir(data: Path, explicit: str | Path | None, names: tuple[str, ...]) -> Path:
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_dir():
            raise DataError(f"image folder not found: {p}")
        return p
    root = data if data.is_dir() else data.parent
    for n in names:
        if (root / n).is_dir():
            return root / n
    return root


def _image_loader(path: Path):
    return lambda: open_image(path)


class VQAv2Task(Task):
    name = "vqav2"
    primary_metric = "overall"
    predictions_format = 'JSON list [{"question_id", "answer"}] (the official results format)'

    def load(
        self,
        data: Path,
        limit: int | None = None,
        questions: str | None = None,
        annotations: str | None = None,
        images: str | None = None,
        image_map: str | None = None,
        **_: Any,
    ) -> list[Item]:
        q_path = Path(questions) if questions else find_one(data, ["*questions*.json"], "VQA questions")
        a_path: Path | None = Path(annotations) if annotations else None
        folder = data if data.is_dir() else data.parent
        if a_path is None and any(folder.glob("*annotations*.json")):
            a_path = find_one(folder, ["*annotations*.json"], "VQA annotations")
        image_dir = find_image_dir(data, images, ("images", "val2014", "test2015"))
        mapping = read_json(image_map, "image mapping") if image_map else None
        qs = read_json(q_path, "VQA questions file")
        if not isinstance(qs, dict) or "questions" not in qs:
            raise DataError(f"{q_path}: expected a JSON object with a 'questions' list (the VQAv2 layout)")
        if a_path is None:
            # test-dev / test: no answers to score; predictions are written in the submission format
            log.info("%s: no annotations file; predicting only (submit predictions_official.json)", q_path)
            return self._unlabeled(qs, q_path, image_dir, mapping, limit)
        anns = read_json(a_path, "VQA annotations file")
        if not isinstance(anns, dict) or "annotations" not in anns:
            raise DataError(f"{a_path}: expected a JSON object with an 'annotations' list (the VQAv2 layout)")
        by_qid: dict[int, dict] = {}
        for i, q in enumerate(qs["questions"]):
            try:
                by_qid[int(q["question_id"])] = q
                q["question"], q["image_id"]  # noqa: B018
            except (KeyError, TypeError, ValueError) as e:
                raise DataError(
                    f"{q_path}, questions[{i}]: needs question_id, image_id and question ({e})"
                ) from e
        items: list[Item] = []
        # evaluation order = the annotation file's order (VQA.getQuesIds)
        for i, ann in enumerate(anns["annotations"]):
            try:
                qid = int(ann["question_id"])
                answers = ann["answers"]
                if not isinstance(answers, list) or not answers or not all("answer" in a for a in answers):
                    raise ValueError("'answers' must be a non-empty list of {answer, ...}")
            except (KeyError, TypeError, ValueError) as e:
                raise DataError(f"{a_path}, annotations[{i}]: {e}") from e
            q = by_qid.get(qid)
            if q is None:
                raise DataError(f"{a_path}, annotations[{i}]: question_id {qid} is not in {q_path}")
            path = coco_image_path(image_dir, q["image_id"], mapping)
            items.append(
                Item(
                    id=str(qid),
                    prompt=f"{q['question']}\n{SHORT_ANSWER_PROMPT}",
                    image=_image_loader(path),
                    meta={
                        "answers": answers,
                        "question_type": ann.get("question_type"),
                        "answer_type": ann.get("answer_type"),
                        "question": q["question"],
                        "image_path": str(path),
                    },
                    group=str(q["image_id"]),
                )
            )
            if limit is not None and len(items) >= limit:
                break
        return items

    def _unlabeled(
        self, qs: dict, q_path: Path, image_dir: Path, mapping: dict | None, limit: int | None
    ) -> list[Item]:
        items = []
        for i, q in enumerate(qs["questions"]):
            try:
                qid, image_id, question = int(q["question_id"]), q["image_id"], q["question"]
            except (KeyError, TypeError, ValueError) as e:
                raise DataError(
                    f"{q_path}, questions[{i}]: needs question_id, image_id and question ({e})"
                ) from e
            path = coco_image_path(image_dir, image_id, mapping)
            items.append(
                Item(
                    id=str(qid),
                    prompt=f"{question}\n{SHORT_ANSWER_PROMPT}",
                    image=_image_loader(path),
                    meta={"answers": None, "question": question, "image_path": str(path)},
                    group=str(image_id),
                )
            )
            if limit is not None and len(items) >= limit:
                break
        return items

    def score(self, items: list[Item], predictions: dict[str, str]) -> dict[str, Any]:
        if any(it.meta["answers"] is None for it in items):
            return {
                "overall": None,
                "num_questions": len(items),
                "num_missing_predictions": sum(it.id not in predictions for it in items),
                "note": "no annotations: submit predictions_official.json to the evaluation server",
            }
        rows = []
        missing = 0
        for it in items:
            pred = predictions.get(it.id)
            if pred is None:
                missing += 1
                pred = ""
            rows.append(
                (
                    vqa_accuracy(pred, it.meta["answers"]),
                    it.meta.get("question_type"),
                    it.meta.get("answer_type"),
                )
            )
        out = aggregate(rows)
        out["num_questions"] = len(items)
        out["num_missing_predictions"] = missing
        return out

    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        return read_vqa_results(path)

    def write_predictions(self, path: Path, items: list[Item], predictions: dict[str, str]) -> Path:
        path = path.with_suffix(".json")
        atomic_write_json(
            path, [{"question_id": int(it.id), "answer": predictions.get(it.id, "")} for it in items]
        )
        return path


def read_vqa_results(path: Path) -> dict[str, str]:
    """The official results format: a JSON list of {"question_id", "answer"}."""
    res = read_json(path, "VQA results file")
    if not isinstance(res, list):
        raise DataError(
            f'{path}: expected a JSON list of {{"question_id", "answer"}} (the VQA results format)'
        )
    out: dict[str, str] = {}
    for i, r in enumerate(res):
        if not isinstance(r, dict) or "question_id" not in r or "answer" not in r:
            raise DataError(f'{path}, entry {i}: needs "question_id" and "answer"')
        out[str(int(r["question_id"]))] = str(r["answer"])
    return out
