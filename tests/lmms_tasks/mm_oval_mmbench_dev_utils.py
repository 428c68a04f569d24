"""Helpers of the local lmms-eval task `mm_oval_mmbench_dev` (the bundled MMBench-format dev TSV).

The prompt is LLaVA-1.5's (`mm_oval.eval.mmbench.build_prompt`: hint, question and "A. option" lines
joined by newlines), not lmms-eval's `mmbench_en_dev` prompt ("{hint} {question} There are several
options:\\nA. ..."), so that the predictions can be compared with mm-oval's harness. The score is
lmms-eval's MMBench evaluator (`MMBench_Evaluator.eval_result`, CircularEval) with its judge-free
`static` method: OpenCompass's `can_infer` first (mm-oval's rule), then, where that finds no letter,
lmms-eval's `extract_mcq_answer` (mm-oval counts such a row wrong; `mmbench_en_dev` asks a GPT judge)."""

import os
from pathlib import Path

from lmms_eval.tasks.mmbench.mmbench_evals import MMBench_Evaluator
from mm_oval.eval.files import decode_base64_image
from mm_oval.eval.mmbench import OPTION_LETTERS, build_prompt, is_none

_EVALUATOR = MMBench_Evaluator(sys_prompt="There are several options:")


def data_file() -> Path:
    explicit = os.environ.get("MM_OVAL_LMMS_MMBENCH_TSV")
    if explicit:
        return Path(explicit)
    from mm_oval.zoo import bundled_data_dir

    return Path(bundled_data_dir()) / "mmbench_dev.tsv"


def doc_to_visual(doc):
    return [decode_base64_image(doc["image"], f"MMBench index {doc['index']}").convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    options = []
    for letter in OPTION_LETTERS:  # LLaVA's get_options: up to the first option it reads as none
        if letter not in doc or is_none(doc[letter]):
            break
        options.append(doc[letter])
    return build_prompt(doc["question"], doc.get("hint"), options)


def process_results(doc, results):
    row = {k: doc.get(k) for k in ("index", "question", "answer", "hint", "source", "split", "category")}
    row["l2-category"] = doc.get("l2-category")
    row["prediction"] = results[0].strip()
    for c in "ABCD":
        row[c] = doc.get(c, "nan")
    return {"circular_accuracy": row}


def aggregate_circular_accuracy(results):
    overall, _, _ = _EVALUATOR.eval_result(results, eval_method="static")
    return overall * 100
