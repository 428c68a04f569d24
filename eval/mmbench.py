"""MMBench: the official TSV, LLaVA-1.5's prompt, the judge-free answer extraction and CircularEval.

Tables are read as the official tools read them: pandas with its defaults (`read_csv(sep="\\t")`,
`read_csv`, `read_excel`), so an empty, "None", "NA", "N/A", "NaN", "null", ... cell is a missing value.

- Data: TSV columns index, question, hint, A, B, C, D, answer, category, image (base64), l2-category,
  ...; rotated copies of a question (options shifted, answer letter shifted) have index + k * 1e6.
  Tables that store an image only once hold the index of the row with the image in the other rows
  (VLMEvalKit); both are read.
- Prompt (LLaVA-1.5, `model_vqa_mmbench.py --single-pred-prompt`): hint + "\\n" + question when the
  hint is present, then "\\nA. option" for each option up to the first missing one, then
  "\\nAnswer with the option's letter from the given choices directly.". "Missing" is LLaVA's `is_none`:
  a missing cell, or text that lowercases to "nan" or "none". The prompt and the rule are the library's
  (`mm_oval.prompts.mmbench_prompt`), which the bundled model's training data use too.
- Scoring, one rule `opencompass` (open-compass/opencompass 6ca2be6, tools/eval_mmbench.py, which
  lmms-eval's MMBench evaluator copies), without the GPT judge:
  - the options are the cells pandas does not read as missing (`build_choices`), so an option whose
    text is "none" or "NONE" stays; the answer letter is scored even when its own option cell is
    missing (the scorer never checks);
  - each prediction is `str()` of its cell, so a missing prediction is the text "nan";
  - extraction (`can_infer`): over the whitespace tokens of the answer (none when it contains "Failed
    to obtain answer via API"), a bare letter of A-E found exactly once (skipped when "A" is a token of
    an answer with more than 3 tokens: likely the article); else, for each wrapper in order ("", "."),
    ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."), (":", ""), (":", ","), (":", "."),
    (":", ")"), (":", ")."), a wrapped letter found exactly once; else exactly one option's text contained
    in the lowercased answer; else a miss (counted wrong: no judge model);
  - CircularEval over the predictions present: the scorer walks the main rows (index < 1e6) of the
    predictions and, for each, the predicted rows with the same index % 1e6; a question counts only if
    every one of them is extracted and right. A question whose main row has no prediction is dropped
    from the denominator (`num_questions_dropped`), a rotation without one is not scored
    (`num_rotations_without_prediction`); both are counted.
  Reported overall and per category / l2-category of the question's main row.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from mm_oval.errors import DataError
from mm_oval.files import is_missing
from mm_oval.prompts import OPTION_LETTERS, is_none, mmbench_prompt

from .files import decode_base64_image, read_table, write_table
from .tasks import BUNDLED_SETS, Item, Rule, Task, find_one

log = logging.getLogger(__name__)

ROTATION = 1_000_000
FAILED_API = "Failed to obtain answer via API"
MMBENCH_RULES = (
    Rule(
        "opencompass",
        "open-compass/opencompass",
        "6ca2be6626297b06088f0c4aabcfc30426341d78",
        "tools/eval_mmbench.py",
        "pandas-read tables, can_infer without the GPT judge, CircularEval over the predicted rows",
    ),
)
WRAPPERS = [
    ("", "."), ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."),
    (":", ""), (":", ","), (":", "."), (":", ")"), (":", ")."),
]  # fmt: skip


# the task's prompt, the library's (as lmms-eval task files import it from here)
build_prompt = mmbench_prompt


def _index(value: Any, where: str) -> int:
    """An integer index cell (pandas may hand it over as a float)."""
    if isinstance(value, bool) or is_missing(value):
        raise DataError(f"{where}: index {value!r} is not an integer")
    try:
        f = float(value)
        if not f.is_integer():
            raise ValueError
        return int(f)
    except (TypeError, ValueError, OverflowError):
        raise DataError(f"{where}: index {value!r} is not an integer") from None


def _count(splits: list[str], choices: str, prefix: str = "", suffix: str = "") -> int:
    return sum(1 for c in choices if prefix + c + suffix in splits)


def infer_option(answer: str, num_choice: int = 5) -> str | None:
    """A letter named in the answer, or None (`can_infer_option`)."""
    choices = "ABCDE"[:num_choice]
    if FAILED_API in answer:
        return None
    splits = [x.strip() for x in answer.split()]
    if _count(splits, choices) == 1:
        for ch in choices:
            if "A" in splits and len(splits) > 3:
                log.debug("'A' might be a quantifier in %r", answer)
                break
            if ch in splits:
                return ch
    for prefix, suffix in WRAPPERS:
        if _count(splits, choices, prefix, suffix) == 1:
            for ch in choices:
                if prefix + ch + suffix in splits:
                    return ch
    return None


def infer_text(answer: str, choices: dict[str, Any]) -> str | None:
    """The one option whose text is contained in the answer, or None (`can_infer_text`)."""
    answer = answer.lower()
    cands = [k for k, v in choices.items() if str(v).lower() in answer]
    return cands[0] if len(cands) == 1 else None


def extract_answer(answer: str, choices: dict[str, Any]) -> str | None:
    """The letter the answer chooses, or None for a miss."""
    answer = str(answer)
    return infer_option(answer) or infer_text(answer, choices)


class MMBenchTask(Task):
    name = "mmbench"
    title = "MMBench"
    metric_label = "MMBench circular"
    primary_metric = "circular_accuracy"
    data_help = "the TSV"
    bundled = BUNDLED_SETS
    predictions_format = (
        "TSV / CSV / XLSX with columns index and prediction (LLaVA's and VLMEvalKit's outputs)"
    )
    rules = MMBENCH_RULES
    # LLaVA-1.5's MMBench prompt (question, hint, option texts; see the module's docstring)
    prompt = staticmethod(build_prompt)

    def load(self, data: Path, limit: int | None = None, **_: Any) -> list[Item]:
        path = (
            data
            if data.is_file()
            else find_one(data, ["mmbench*dev*.tsv", "mmbench*.tsv", "MMBench*.tsv", "*.tsv"], "MMBench TSV")
        )
        rows = read_table(path, "MMBench TSV")
        need = {"index", "question", "answer", "image", "A", "B"}
        if rows and not need <= set(rows[0]):
            raise DataError(
                f"{path}: missing columns {sorted(need - set(rows[0]))} (expected the official MMBench TSV)"
            )
        parsed: list[tuple[int, dict]] = []
        by_index: dict[int, dict] = {}
        for rowno, row in enumerate(rows, 2):
            index = _index(row["index"], f"{path}, row {rowno}")
            if index in by_index:
                raise DataError(f"{path}, row {rowno}: index {index} repeats row {by_index[index]['_row']}")
            if is_missing(row.get("question")) or is_missing(row.get("answer")):
                raise DataError(f"{path}, row {rowno} (index {index}): empty question or answer")
            row["_row"] = rowno
            parsed.append((index, row))
            by_index[index] = row
        main = [i for i, _ in parsed if i < ROTATION]
        orphans = {i % ROTATION for i, _ in parsed} - set(main)
        if orphans:
            raise DataError(
                f"{path}: rotated rows without their main row (index < 1e6): {sorted(orphans)[:5]}"
            )
        keep = set(main[:limit]) if limit is not None else set(main)
        letters = [c for c in OPTION_LETTERS if c in rows[0]] if rows else []
        items: list[Item] = []
        for index, row in parsed:
            if index % ROTATION not in keep:
                continue
            where = f"{path}, row {row['_row']} (index {index})"
            options = []  # LLaVA's get_options: up to the first option it reads as none
            for letter in OPTION_LETTERS:
                if letter not in row or is_none(row[letter]):
                    break
                options.append(row[letter])
            # the official scorer's build_choices: every cell pandas does not read as missing
            choices = {c: row[c] for c in letters if not is_missing(row[c])}
            answer = str(row["answer"]).strip()
            if answer not in letters:
                raise DataError(
                    f"{where}: answer {row['answer']!r} is not an option letter ({', '.join(letters)})"
                )
            image_cell = row.get("image")
            if is_missing(image_cell):
                raise DataError(f"{where}: empty image cell")
            if not isinstance(image_cell, str) or (len(image_cell) <= 64 and image_cell.strip().isdecimal()):
                ref = by_index.get(_index(image_cell, where))
                if ref is None or not isinstance(ref.get("image"), str):
                    raise DataError(f"{where}: image refers to index {image_cell}, which holds no image")
                image_cell = ref["image"]
            main_row = by_index.get(index % ROTATION, row)
            items.append(
                Item(
                    id=str(index),
                    prompt=self.prompt(row["question"], row.get("hint"), options),
                    image=(lambda cell=image_cell, w=where: decode_base64_image(cell, w)),
                    meta={
                        "answer": answer,
                        "choices": choices,
                        "category": _label(main_row.get("category")),
                        "l2_category": _label(main_row.get("l2-category", main_row.get("l2_category"))),
                        "question": str(row["question"]),
                    },
                )
            )
        return items

    def score(
        self, items: list[Item], predictions: dict[str, str], rules: str | None = None
    ) -> dict[str, Any]:
        rule = self.rule(rules)
        groups: dict[int, list[Item]] = defaultdict(list)
        for it in items:
            groups[int(it.id) % ROTATION].append(it)
        hits: dict[int, int] = {}
        extracted_right = scored_rows = misses = dropped = unscored_rotations = 0
        for g, members in sorted(groups.items()):
            if str(g) not in predictions:
                # eval_result walks the main rows of the predictions: this question is not scored
                dropped += 1
                continue
            ok = True
            for it in sorted(members, key=lambda x: int(x.id)):
                if it.id not in predictions:
                    unscored_rotations += 1
                    continue
                pred = extract_answer(predictions[it.id], dict(it.meta["choices"]))
                if pred is None:
                    misses += 1
                right = pred == it.meta["answer"]
                extracted_right += right
                scored_rows += 1
                ok = ok and right
            hits[g] = int(ok)
        main_meta = {int(it.id): it.meta for it in items if int(it.id) < ROTATION}
        by_cat: dict[str, list[int]] = defaultdict(list)
        by_l2: dict[str, list[int]] = defaultdict(list)
        for g, h in hits.items():
            by_cat[main_meta[g]["category"]].append(h)
            by_l2[main_meta[g]["l2_category"]].append(h)
        n = len(hits)
        out: dict[str, Any] = {
            # None: no question has a prediction (the script's mean over nothing)
            "circular_accuracy": 100.0 * sum(hits.values()) / n if n else None,
            "per_category": {k: 100.0 * sum(v) / len(v) for k, v in sorted(by_cat.items())},
            "per_l2_category": {k: 100.0 * sum(v) / len(v) for k, v in sorted(by_l2.items())},
            # every scored row on its own (no circular rule): what single-pass scoring would report
            "single_pass_accuracy": 100.0 * extracted_right / scored_rows if scored_rows else None,
            "num_questions": n,
            "num_rows": scored_rows,
            "num_extraction_misses": misses,
            "num_missing_predictions": sum(it.id not in predictions for it in items),
            "num_questions_dropped": dropped,
            "num_rotations_without_prediction": unscored_rotations,
            "rules": rule.record(),
        }
        return out

    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        rows = read_table(path, "MMBench predictions")
        # eval_result lower-cases every column name but A-D
        rows = [{(k if k in OPTION_LETTERS else k.lower()): v for k, v in r.items()} for r in rows]
        if rows and not {"index", "prediction"} <= set(rows[0]):
            raise DataError(f"{path}: needs columns 'index' and 'prediction' (found {sorted(rows[0])})")
        out: dict[str, str] = {}
        first: dict[str, int] = {}
        for rowno, r in enumerate(rows, 2):
            key = str(_index(r["index"], f"{path}, row {rowno}"))
            if key in out:
                raise DataError(f"{path}, row {rowno}: index {key} repeats row {first[key]}")
            # `data['prediction'] = [str(x) for x in data['prediction']]`: a missing cell is "nan"
            out[key], first[key] = str(r["prediction"]), rowno
        ids = {it.id for it in items}
        if items and not ids & set(out):
            raise DataError(
                f"{path}: none of its {len(out)} rows has the index of a question in the data "
                "(predictions for another MMBench file?)"
            )
        return out

    def write_predictions(self, path: Path, items: list[Item], predictions: dict[str, str]) -> Path:
        path = path.with_suffix(".tsv")
        cols = ["index", "question", "A", "B", "C", "D", "answer", "prediction", "category", "l2-category"]
        rows = []
        for it in items:
            r = {"index": it.id, "question": it.meta["question"], "answer": it.meta["answer"],
                 "prediction": predictions.get(it.id, ""), "category": it.meta["category"],
                 "l2-category": it.meta["l2_category"]}  # fmt: skip
            r.update(it.meta["choices"])
            rows.append(r)
        write_table(path, rows, cols)
        return path


def _label(cell: Any) -> str:
    return "uncategorized" if is_missing(cell) else str(cell)
