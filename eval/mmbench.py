"""MMBench: the official TSV, LLaVA-1.5's prompt, the judge-free answer extraction and CircularEval.

- Data: TSV columns index, question, hint, A, B, C, D, answer, category, image (base64), l2-category,
  ...; rotated copies of a question (options shifted, answer letter shifted) have index + k * 1e6.
  Tables that store an image only once hold the index of the row with the image in the other rows
  (VLMEvalKit); both are read.
- Prompt (LLaVA-1.5, `model_vqa_mmbench.py --single-pred-prompt`): hint + "\\n" + question when the
  hint is present, then "\\nA. option" for each option up to the first missing one, then
  "\\nAnswer with the option's letter from the given choices directly.". A cell counts as missing the
  way pandas reads it (empty, "nan", "None", "NA", ...), as LLaVA's script sees it.
- Extraction (lmms-eval's MMBench_Evaluator.can_infer without the GPT judge): over the whitespace
  tokens of the answer, a bare letter of A-E found exactly once (skipped when "A" is a token of an
  answer with more than 3 tokens: likely the article); else, for each wrapper in order ("", "."),
  ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."), (":", ""), (":", ","), (":", "."),
  (":", ")"), (":", ")."), a wrapped letter found exactly once; else exactly one option's text contained
  in the lowercased answer; else a miss (counted wrong: no judge model).
- CircularEval: a question counts only if every rotation (index % 1e6 equal) is extracted and right.
  Reported overall and per category / l2-category of the question's first (index < 1e6) row.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import DataError
from .files import decode_base64_image, read_table, write_table
from .tasks import Item, Task, find_one

log = logging.getLogger(__name__)

OPTION_LETTERS = ["A", "B", "C", "D"]
INSTRUCTION = "Answer with the option's letter from the given choices directly."
ROTATION = 1_000_000
# pandas.read_table's default NA strings: LLaVA's script reads the TSV with pandas, so these cells are "missing"
PANDAS_NA = {
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
    "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
}  # fmt: skip
WRAPPERS = [
    ("", "."), ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."),
    (":", ""), (":", ","), (":", "."), (":", ")"), (":", ")."),
]  # fmt: skip


def is_none(cell: str | None) -> bool:
    return cell is None or cell in PANDAS_NA or cell.lower() in ("nan", "none")


def build_prompt(question: str, hint: str | None, options: list[str]) -> str:
    """LLaVA-1.5's MMBench prompt (without the image token, which the chat template adds)."""
    text = question
    if not is_none(hint):
        text = f"{hint}\n{text}"
    for letter, option in zip(OPTION_LETTERS, options):
        text += f"\n{letter}. {option}"
    return f"{text}\n{INSTRUCTION}"


def _count(splits: list[str], choices: str, prefix: str = "", suffix: str = "") -> int:
    return sum(1 for c in choices if prefix + c + suffix in splits)


def infer_option(answer: str, num_choice: int = 5) -> str | None:
    """A letter named in the answer, or None (`can_infer_option`)."""
    choices = "ABCDE"[:num_choice]
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


def infer_text(answer: str, choices: dict[str, str]) -> str | None:
    """The one option whose text is contained in the answer, or None (`can_infer_text`)."""
    answer = answer.lower()
    cands = [k for k, v in choices.items() if str(v).lower() in answer]
    return cands[0] if len(cands) == 1 else None


def extract_answer(answer: str, choices: dict[str, str]) -> str | None:
    """The letter the answer chooses, or None for a miss."""
    answer = str(answer)
    return infer_option(answer) or infer_text(answer, choices)


class MMBenchTask(Task):
    name = "mmbench"
    primary_metric = "circular_accuracy"
    predictions_format = (
        "TSV / CSV / XLSX with columns index and prediction (LLaVA's and VLMEvalKit's outputs)"
    )

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
            try:
                index = int(float(row["index"]))
            except (TypeError, ValueError):
                raise DataError(f"{path}, row {rowno}: index {row['index']!r} is not an integer") from None
            if is_none(row.get("question")) or is_none(row.get("answer")):
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
        items: list[Item] = []
        for index, row in parsed:
            if index % ROTATION not in keep:
                continue
            options = []
            for letter in OPTION_LETTERS:
                if letter not in row or is_none(row[letter]):
                    break
                options.append(row[letter])
            choices = {c: row[c] for c in OPTION_LETTERS if c in row and not is_none(row[c])}
            answer = row["answer"].strip()
            if answer not in choices:
                raise DataError(
                    f"{path}, row {row['_row']} (index {index}): answer {answer!r} is not one of its options"
                )
            image_cell = row.get("image")
            if is_none(image_cell):
                raise DataError(f"{path}, row {row['_row']} (index {index}): empty image cell")
            if len(image_cell) <= 64 and image_cell.strip().isdigit():
                ref = by_index.get(int(image_cell))
                if ref is None:
                    raise DataError(
                        f"{path}, row {row['_row']}: image refers to index {image_cell}, which is not in the table"
                    )
                image_cell = ref["image"]
            where = f"{path}, row {row['_row']} (index {index})"
            main_row = by_index.get(index % ROTATION, row)
            items.append(
                Item(
                    id=str(index),
                    prompt=build_prompt(row["question"], row.get("hint"), options),
                    image=(lambda cell=image_cell, w=where: decode_base64_image(cell, w)),
                    meta={
                        "answer": answer,
                        "choices": choices,
                        "category": main_row.get("category") or "uncategorized",
                        "l2_category": main_row.get("l2-category")
                        or main_row.get("l2_category")
                        or "uncategorized",
                        "question": row["question"],
                    },
                )
            )
        return items

    def score(self, items: list[Item], predictions: dict[str, str]) -> dict[str, Any]:
        groups: dict[int, list[Item]] = defaultdict(list)
        for it in items:
            groups[int(it.id) % ROTATION].append(it)
        hits: dict[int, int] = {}
        extracted_right = 0
        misses = 0
        for g, members in sorted(groups.items()):
            ok = True
            for it in sorted(members, key=lambda x: int(x.id)):
                pred = extract_answer(predictions.get(it.id, ""), dict(it.meta["choices"]))
                if pred is None:
                    misses += 1
                right = pred == it.meta["answer"]
                extracted_right += right
                ok = ok and right
            hits[g] = int(ok)
        main_meta = {int(it.id): it.meta for it in items if int(it.id) < ROTATION}
        by_cat: dict[str, list[int]] = defaultdict(list)
        by_l2: dict[str, list[int]] = defaultdict(list)
        for g, h in hits.items():
            by_cat[main_meta[g]["category"]].append(h)
            by_l2[main_meta[g]["l2_category"]].append(h)
        n = len(hits)
        return {
            "circular_accuracy": 100.0 * sum(hits.values()) / n if n else 0.0,
            "per_category": {k: 100.0 * sum(v) / len(v) for k, v in sorted(by_cat.items())},
            "per_l2_category": {k: 100.0 * sum(v) / len(v) for k, v in sorted(by_l2.items())},
            # every row on its own (no circular rule): what single-pass scoring would report
            "single_pass_accuracy": 100.0 * extracted_right / len(items) if items else 0.0,
            "num_questions": n,
            "num_rows": len(items),
            "num_extraction_misses": misses,
            "num_missing_predictions": sum(it.id not in predictions for it in items),
        }

    def read_predictions(self, path: Path, items: list[Item]) -> dict[str, str]:
        rows = read_table(path, "MMBench predictions")
        if rows and not {"index", "prediction"} <= set(rows[0]):
            raise DataError(f"{path}: needs columns 'index' and 'prediction' (found {sorted(rows[0])})")
        out = {}
        for rowno, r in enumerate(rows, 2):
            try:
                out[str(int(float(r["index"])))] = "" if r["prediction"] is None else str(r["prediction"])
            except (TypeError, ValueError):
                raise DataError(f"{path}, row {rowno}: index {r['index']!r} is not an integer") from None
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
