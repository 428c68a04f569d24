"""VQAv2: data loading and accuracy under three named rules, because the official sources disagree.

Every rule computes the same leave-one-out accuracy: each of the human answers is left out in turn (the
scripts compare the answer dicts), the prediction scores min(1, #matching others / 3), the scores are
averaged; overall / per question type / per answer type are round(100 * mean, 2). They differ in what
is normalised before matching (`--rules`, default `lmms-eval`):

- `lmms-eval` (EvolvingLMMs-Lab/lmms-eval 7548ebe, lmms_eval/tasks/vqav2/utils.py, `vqav2_val`): the
  prediction first goes through the whole EvalAI answer processor (lowercase, drop ',' and '?', "'s" ->
  " 's", punctuation, digits/articles/contractions); the answers are newline/tab-stripped; then master's
  rule below with the processor's own punctuation and digit/article steps. LLaVA's
  scripts/convert_vqav2_for_submission.py also runs the EvalAI processor before the challenge server
  scores, so this is the rule published LLaVA-1.5 val numbers are compared against.
- `vqaeval` (GT-Vision-Lab/VQA master a013f00 "Fixed processing answers bug",
  PythonEvaluationTools/vqaEvaluation/vqaEval.py): answers and prediction are newline/tab-stripped;
  when the answers differ, both sides get `processPunctuation` then `processDigitArticle`; when they
  are all identical, neither side is normalised (so "YES" does not match ten "yes").
- `vqaeval-2017` (GT-Vision-Lab/VQA c4e6a0e, the Python 3 head of an unmerged pull request; its rule
  equals master from 458a8b2, 2016, up to a013f00): the prediction always gets `processPunctuation`
  then `processDigitArticle`; the answers get `processPunctuation` only, and only when they differ (so
  ten identical "hot-dog" match no prediction).

The tables and quirks are reproduced, not fixed (checked entry by entry against both revisions and
lmms-eval's `EvalAIAnswerProcessor`): `processPunctuation` deletes each of its 21 marks when the
*original* text has it next to a space or contains a digit-comma-digit, else replaces it by a space
(`'` and `:` are not in the list); the period regex `(?!<=\\d)(\\.)(?!\\d)` has its look-behind
misspelt as a look-ahead, so every '.' not followed by a digit goes, and is applied with `re.UNICODE`
passed as the *count* (at most 32 periods removed); `processDigitArticle` lowercases, maps number words
(and 'none') to digits, drops a/an/the and expands the contractions map. The EvalAI processor differs
only in its comma regex `(?<=\\d)(\\,)+(?=\\d)` and its word-tokenising first step.

As in the VQA API (`VQA.getQuesIds` iterates the annotations), questions without an annotation are not
scored: they are counted (`num_questions_without_annotations`) and logged. A repeated question_id (in
the questions, annotations or results file) is an error, never a silent replacement.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from mm_oval.errors import ConfigError, DataError
from mm_oval.files import atomic_write_json
from mm_oval.prompts import load_image, short_answer_prompt

from .files import read_json
from .tasks import BUNDLED_SETS, DataOption, Item, Rule, Task, find_one

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


# EvalAIAnswerProcessor's tables equal vqaEval.py's (checked entry by entry); only the comma regex differs
EVALAI_COMMA_STRIP = re.compile(r"(?<=\d)(\,)+(?=\d)")


def evalai_word_tokenize(word: str) -> str:
    word = word.lower()
    word = word.replace(",", "").replace("?", "").replace("'s", " 's")
    return word.strip()


def evalai_normalize(item: str) -> str:
    """`EvalAIAnswerProcessor.__call__` (lmms-eval, LLaVA's m4c_evaluator, MMF)."""
    item = evalai_word_tokenize(item)
    item = item.replace("\n", " ").replace("\t", " ").strip()
    item = process_punctuation(item, EVALAI_COMMA_STRIP)
    return process_digit_article(item)


def _strip(text: str) -> str:
    return text.replace("\n", " ").replace("\t", " ").strip()


def normalize_prediction(answer: str) -> str:
    """What `VQAEval.evaluate` of the 2017 revision does to a predicted answer before matching."""
    return process_digit_article(process_punctuation(_strip(answer)))


def normalize_ground_truth(answers: list[str]) -> list[str]:
    """What the 2017 revision does to the human answers: punctuation only, and only when they differ."""
    if len(set(answers)) > 1:
        return [process_punctuation(a) for a in answers]
    return list(answers)


VQA_RULES = (
    Rule(
        "lmms-eval",
        "EvolvingLMMs-Lab/lmms-eval",
        "7548ebe112b01da4973f854b1c3d3c1c44abd5a9",
        "lmms_eval/tasks/vqav2/utils.py",
        "EvalAI answer processor on the prediction, then vqaEval master's rule with the processor's steps",
    ),
    Rule(
        "vqaeval",
        "GT-Vision-Lab/VQA",
        "a013f0043c1e2cdc995922dfe257f7149aa9af06",
        "PythonEvaluationTools/vqaEvaluation/vqaEval.py",
        "both sides normalised when the answers differ, neither when they are identical",
    ),
    Rule(
        "vqaeval-2017",
        "GT-Vision-Lab/VQA",
        "c4e6a0e4e84b9702d99800d3393652d92b5df224",
        "PythonEvaluationTools/vqaEvaluation/vqaEval.py",
        "prediction always normalised; answers punctuation-processed only, and only when they differ",
    ),
)
VQA_RULE_NAMES = tuple(r.name for r in VQA_RULES)


def normalize_pair(prediction: str, answers: list[str], rule: str = "lmms-eval") -> tuple[str, list[str]]:
    """The prediction and the human answers as `rule` compares them."""
    if rule == "vqaeval-2017":
        return normalize_prediction(prediction), normalize_ground_truth(answers)
    if rule not in VQA_RULE_NAMES:
        raise ConfigError(f"unknown VQAv2 rule {rule!r}; choose one of: {', '.join(VQA_RULE_NAMES)}")
    answers = [_strip(a) for a in answers]
    if rule == "lmms-eval":
        pred = evalai_normalize(prediction)
        comma = EVALAI_COMMA_STRIP
    else:
        pred = _strip(prediction)
        comma = COMMA_STRIP
    if len(set(answers)) > 1:
        answers = [process_digit_article(process_punctuation(a, comma)) for a in answers]
        pred = process_digit_article(process_punctuation(pred, comma))
    return pred, answers


def vqa_accuracy(prediction: str, gt_answers: list[dict] | list[str], rule: str = "lmms-eval") -> float:
    """Accuracy of one prediction (0..1, unrounded) against the human answers of one question.

    `gt_answers` are the annotation's answer dicts ({answer, answer_confidence, answer_id}) or plain
    strings. As in the scripts, "leaving one out" removes every entry equal to the left-out one (with
    real annotations the answer ids make each entry unique)."""
    dicts = [dict(a) if isinstance(a, dict) else {"answer": a, "_pos": i} for i, a in enumerate(gt_answers)]
    if not dicts:
        raise DataError("a VQA question has no human answers")
    res, processed = normalize_pair(prediction, [d["answer"] for d in dicts], rule)
    for d, a in zip(dicts, processed):
        d["answer"] = a
    accs = []
    for left_out in dicts:
        others = [d for d in dicts if d != left_out]
        matching = [d for d in others if d["answer"] == res]
        accs.append(min(1, float(len(matching)) / 3))
    return float(sum(accs)) / len(accs)


def _label(ann: dict, key: str, where: str) -> str | None:
    """An annotation's question_type / answer_type: a string, or absent (then not broken down)."""
    value = ann.get(key)
    if value is not None and not isinstance(value, str):
        raise DataError(f'{where}: {key} must be a string such as "what color", got {value!r}')
    return value


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
    return lambda: load_image(path)


def question_id(value: Any, where: str) -> int:
    """A VQA question id: an integer (or a string of digits), as the official files hold."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise DataError(f"{where}: question_id {value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise DataError(f"{where}: question_id {value!r} is not an integer") from None


def _answers(ann: Any, where: str) -> list[dict]:
    answers = ann.get("answers") if isinstance(ann, dict) else None
    if (
        not isinstance(answers, list)
        or not answers
        or not all(isinstance(a, dict) and isinstance(a.get("answer"), str) for a in answers)
    ):
        raise DataError(f"{where}: 'answers' must be a non-empty list of {{\"answer\": text, ...}}")
    return answers


def _question(q: Any, where: str) -> tuple[int, int | str, str]:
    if not isinstance(q, dict) or not {"question_id", "image_id", "question"} <= set(q):
        raise DataError(f"{where}: needs question_id, image_id and question")
    qid = question_id(q["question_id"], where)
    if not isinstance(q["question"], str):
        raise DataError(f"{where}: question must be text, got {type(q['question']).__name__}")
    if isinstance(q["image_id"], bool) or not isinstance(q["image_id"], (int, str)):
        raise DataError(f"{where}: image_id {q['image_id']!r} is neither a number nor a name")
    return qid, q["image_id"], q["question"]


def _list_in(blob: Any, key: str, path: Path, what: str) -> list:
    if not isinstance(blob, dict) or not isinstance(blob.get(key), list):
        raise DataError(f"{path}: expected a JSON object with a {key!r} list (the VQAv2 {what} layout)")
    return blob[key]


class VQAv2Task(Task):
    name = "vqav2"
    title = "VQAv2"
    metric_label = "VQAv2 acc"
    primary_metric = "overall"
    data_help = "folder with *questions*.json, *annotations*.json and the images"
    data_options = (
        DataOption("questions", "questions file (overrides the search in --data)"),
        DataOption("annotations", "annotations file (overrides the search in --data)"),
        DataOption("images", "image folder (default: images/, val2014/ or test2015/ beside the data)"),
        DataOption("image_map", "JSON {image_id: file name} instead of COCO file names"),
    )
    bundled = BUNDLED_SETS
    predictions_format = 'JSON list [{"question_id", "answer"}] (the official results format)'
    rules = VQA_RULES
    # LLaVA-1.5's short-answer prompt: the question, then "Answer the question using a single word or phrase."
    prompt = staticmethod(short_answer_prompt)

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
        self.load_counts: dict[str, int] = {}
        q_path = Path(questions) if questions else find_one(data, ["*questions*.json"], "VQA questions")
        a_path: Path | None = Path(annotations) if annotations else None
        folder = data if data.is_dir() else data.parent
        if a_path is None and any(folder.glob("*annotations*.json")):
            a_path = find_one(folder, ["*annotations*.json"], "VQA annotations")
        image_dir = find_image_dir(data, images, ("images", "val2014", "test2015"))
        mapping = read_json(image_map, "image mapping") if image_map else None
        if mapping is not None and not isinstance(mapping, dict):
            raise DataError(f"{image_map}: expected a JSON object {{image_id: file name}}")
        by_qid: dict[int, tuple[int | str, str]] = {}
        first_at: dict[int, int] = {}
        for i, q in enumerate(
            _list_in(read_json(q_path, "VQA questions file"), "questions", q_path, "questions")
        ):
            qid, image_id, question = _question(q, f"{q_path}, questions[{i}]")
            if qid in by_qid:
                raise DataError(
                    f"{q_path}, questions[{i}]: question_id {qid} repeats questions[{first_at[qid]}]; "
                    "each question needs its own id"
                )
            by_qid[qid], first_at[qid] = (image_id, question), i
        if a_path is None:
            # test-dev / test: no answers to score; predictions are written in the submission format
            log.info("%s: no annotations file; predicting only (submit predictions_official.json)", q_path)
            return self._items([(qid, None, None, None) for qid in by_qid], by_qid, image_dir, mapping, limit)
        anns = _list_in(read_json(a_path, "VQA annotations file"), "annotations", a_path, "annotations")
        rows: list[tuple[int, list[dict], Any, Any]] = []
        seen: dict[int, int] = {}
        # evaluation order = the annotation file's order (VQA.getQuesIds)
        for i, ann in enumerate(anns):
            where = f"{a_path}, annotations[{i}]"
            if not isinstance(ann, dict) or "question_id" not in ann:
                raise DataError(f"{where}: needs question_id and answers")
            qid = question_id(ann["question_id"], where)
            answers = _answers(ann, where)
            if qid in seen:
                raise DataError(f"{where}: question_id {qid} repeats annotations[{seen[qid]}]")
            seen[qid] = i
            if qid not in by_qid:
                raise DataError(f"{where}: question_id {qid} is not in {q_path}")
            rows.append(
                (qid, answers, _label(ann, "question_type", where), _label(ann, "answer_type", where))
            )
        unannotated = len(by_qid) - len(seen)
        self.load_counts = {
            "num_questions_in_file": len(by_qid),
            "num_questions_without_annotations": unannotated,
        }
        if unannotated:
            log.warning(
                "%s: %d of its %d questions have no annotation in %s and are not scored (as in the VQA API)",
                q_path, unannotated, len(by_qid), a_path,
            )  # fmt: skip
        return self._items(rows, by_qid, image_dir, mapping, limit)

    def _items(
        self, rows: list, by_qid: dict, image_dir: Path, mapping: dict | None, limit: int | None
    ) -> list[Item]:
        items: list[Item] = []
        for qid, answers, question_type, answer_type in rows:
            image_id, question = by_qid[qid]
            path = coco_image_path(image_dir, image_id, mapping)
            meta: dict[str, Any] = {"answers": answers, "question": question, "image_path": str(path)}
            if answers is not None:
                meta.update(question_type=question_type, answer_type=answer_type)
            items.append(
                Item(
                    id=str(qid),
                    prompt=self.prompt(question),
                    image=_image_loader(path),
                    meta=meta,
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
        if any(it.meta["answers"] is None for it in items):
            return {
                "overall": None,
                "num_questions": len(items),
                "num_missing_predictions": sum(it.id not in predictions for it in items),
                "note": "no annotations: submit predictions_official.json to the evaluation server",
                "rules": rule.record(),
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
                    vqa_accuracy(pred, it.meta["answers"], rule.name),
                    it.meta.get("question_type"),
                    it.meta.get("answer_type"),
                )
            )
        out = aggregate(rows)
        out["num_questions"] = len(items)
        out["num_missing_predictions"] = missing
        out.update(getattr(self, "load_counts", {}))
        out["rules"] = rule.record()
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
    """The official results format: a JSON list of {"question_id", "answer"}; a repeated id is an error."""
    res = read_json(path, "VQA results file")
    if not isinstance(res, list):
        raise DataError(
            f'{path}: expected a JSON list of {{"question_id", "answer"}} (the VQA results format)'
        )
    out: dict[str, str] = {}
    first: dict[str, int] = {}
    for i, r in enumerate(res):
        if not isinstance(r, dict) or "question_id" not in r or "answer" not in r:
            raise DataError(f'{path}, entry {i}: needs "question_id" and "answer"')
        if not isinstance(r["answer"], str):
            raise DataError(f"{path}, entry {i}: answer {r['answer']!r} is not text")
        qid = r["question_id"]
        if isinstance(qid, bool) or not isinstance(qid, (int, str)):
            raise DataError(f"{path}, entry {i}: question_id {qid!r} is neither a number nor a name")
        key = str(int(qid)) if isinstance(qid, int) or qid.isdecimal() else qid
        if key in out:
            raise DataError(f"{path}, entry {i}: question_id {qid!r} repeats entry {first[key]}")
        out[key], first[key] = r["answer"], i
    return out
