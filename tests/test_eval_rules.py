"""The named scoring rules where the official sources disagree, and the data and prediction files each
task's official tools would read differently from a naive reader (hand-worked cases, no model)."""

import json

import pytest
from mm_oval.eval.mmbench import MMBenchTask, extract_answer
from mm_oval.eval.pope import POPETask
from mm_oval.eval.runner import score_file
from mm_oval.eval.tasks import Item, get_task
from mm_oval.eval.textvqa import TextVQATask
from mm_oval.eval.vqa import VQAv2Task, vqa_accuracy

from mm_oval.cli import main
from mm_oval.errors import ConfigError, DataError

# ---------------------------------------------------------------- VQAv2: three rules


@pytest.mark.parametrize(
    "prediction, answers, expected",
    [
        # identical answers: master normalises neither side, so case matters; the others lowercase the prediction
        ("YES", ["yes"] * 10, {"lmms-eval": 1.0, "vqaeval": 0.0, "vqaeval-2017": 1.0}),
        # identical answers: master compares raw text; 2017 and lmms-eval turn the prediction into "hot dog"
        ("hot-dog", ["hot-dog"] * 10, {"lmms-eval": 0.0, "vqaeval": 1.0, "vqaeval-2017": 0.0}),
        # answers that differ only by punctuation: master and lmms-eval also map "Two" -> "2" on the
        # answers; 2017 gives the answers punctuation only ("Two" stays, the prediction becomes "2")
        ("two", ["Two"] * 5 + ["Two."] * 5, {"lmms-eval": 1.0, "vqaeval": 1.0, "vqaeval-2017": 0.0}),
        # differing answers: only lmms-eval's first EvalAI pass splits "'s" off the prediction
        ("dog's", ["dog's"] * 5 + ["dog's."] * 5, {"lmms-eval": 0.0, "vqaeval": 1.0, "vqaeval-2017": 1.0}),
        # newlines in the answers: master and lmms-eval strip them, 2017 does not
        ("cat", ["cat\n"] * 10, {"lmms-eval": 1.0, "vqaeval": 1.0, "vqaeval-2017": 0.0}),
    ],
)
def test_vqav2_rules_on_cases_where_the_sources_differ(prediction, answers, expected):
    got = {rule: vqa_accuracy(prediction, answers, rule) for rule in expected}
    assert got == expected


def _vqa_files(tmp_path, n_questions=12, n_annotated=6, answers=None):
    qs = [{"question_id": 100 + i, "image_id": 1, "question": f"q{i}?"} for i in range(n_questions)]
    anns = [
        {
            "question_id": 100 + i,
            "image_id": 1,
            "question_type": "what",
            "answer_type": "other",
            "answers": [
                {"answer": a, "answer_confidence": "yes", "answer_id": k + 1}
                for k, a in enumerate(answers or ["yes"] * 10)
            ],
        }
        for i in range(n_annotated)
    ]
    (tmp_path / "v2_questions.json").write_text(json.dumps({"questions": qs}))
    (tmp_path / "v2_annotations.json").write_text(json.dumps({"annotations": anns}))
    return qs


def test_vqav2_rule_is_chosen_recorded_and_printed(tmp_path, capsys):
    _vqa_files(tmp_path, n_questions=1, n_annotated=1)
    (tmp_path / "preds.json").write_text(json.dumps([{"question_id": 100, "answer": "YES"}]))
    by_rule = {
        rule: score_file("vqav2", tmp_path, tmp_path / "preds.json", rules=rule)["scores"]
        for rule in (None, "vqaeval", "vqaeval-2017")
    }
    assert {r: s["overall"] for r, s in by_rule.items()} == {
        None: 100.0,
        "vqaeval": 0.0,
        "vqaeval-2017": 100.0,
    }
    assert by_rule[None]["rules"]["name"] == "lmms-eval"  # the default
    assert by_rule["vqaeval"]["rules"]["source"] == {
        "repository": "GT-Vision-Lab/VQA",
        "commit": "a013f0043c1e2cdc995922dfe257f7149aa9af06",
        "file": "PythonEvaluationTools/vqaEvaluation/vqaEval.py",
    }
    out = tmp_path / "scored.json"
    argv = [
        "score",
        "--task",
        "vqav2",
        "--data",
        str(tmp_path),
        "--predictions",
        str(tmp_path / "preds.json"),
    ]
    assert main(argv + ["--rules", "vqaeval", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "overall = 0.00" in printed
    assert "rules: vqaeval (GT-Vision-Lab/VQA @ a013f0043c1e2cdc995922dfe257f7149aa9af06" in printed
    assert json.loads(out.read_text())["scores"]["rules"]["name"] == "vqaeval"


def test_unknown_rule_is_a_config_error_naming_the_valid_ones(tmp_path, capsys):
    with pytest.raises(ConfigError, match="lmms-eval, vqaeval, vqaeval-2017"):
        VQAv2Task().rule("vqa")
    with pytest.raises(ConfigError, match="choose one of: llava"):
        score_file("pope", tmp_path, tmp_path / "none.jsonl", rules="lmms-eval")
    argv = ["score", "--task", "mmbench", "--data", str(tmp_path), "--predictions", "p.tsv", "--rules", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown scoring rule 'x' for mmbench; choose one of: opencompass" in err[0]


def test_every_task_records_its_rule_and_source(tmp_path):
    items = [Item(id="1", prompt="", image=lambda: None, meta={"label": "yes", "category": "c"})]
    rec = POPETask().score(items, {"1": "Yes"})["rules"]
    assert rec["name"] == "llava" and rec["source"]["file"] == "llava/eval/eval_pope.py"
    items = [Item(id="1", prompt="", image=lambda: None, meta={"answers": ["a"] * 10})]
    assert TextVQATask().score(items, {"1": "a"})["rules"]["source"]["file"] == "llava/eval/m4c_evaluator.py"
    meta = {
        "answer": "A",
        "choices": {"A": "x", "B": "y"},
        "category": "c",
        "l2_category": "l",
        "question": "",
    }
    items = [Item(id="1", prompt="", image=lambda: None, meta=meta)]
    rec = MMBenchTask().score(items, {"1": "A"})["rules"]
    assert rec["source"]["repository"] == "open-compass/opencompass" and len(rec["source"]["commit"]) == 40


# ---------------------------------------------------------------- VQAv2 data files


def test_vqav2_questions_without_annotation_are_counted(tmp_path):
    _vqa_files(tmp_path, n_questions=12, n_annotated=6)
    (tmp_path / "preds.json").write_text(
        json.dumps([{"question_id": 100 + i, "answer": "yes"} for i in range(12)])
    )
    s = score_file("vqav2", tmp_path, tmp_path / "preds.json")["scores"]
    assert s["num_questions"] == 6
    assert s["num_questions_in_file"] == 12
    assert s["num_questions_without_annotations"] == 6


def test_vqav2_repeated_question_id_is_an_error(tmp_path):
    qs = _vqa_files(tmp_path, n_questions=3, n_annotated=3)
    qs[2]["question_id"] = 100  # the third question reuses the first one's id
    (tmp_path / "v2_questions.json").write_text(json.dumps({"questions": qs}))
    with pytest.raises(DataError, match=r"questions\[2\]: question_id 100 repeats questions\[0\]"):
        VQAv2Task().load(tmp_path)
    (tmp_path / "preds.json").write_text(json.dumps([{"question_id": 1, "answer": "a"}] * 2))
    with pytest.raises(DataError, match="entry 1: question_id 1 repeats entry 0"):
        VQAv2Task().read_predictions(tmp_path / "preds.json", [])


def test_vqav2_question_and_answer_types_must_be_strings(tmp_path):
    _vqa_files(tmp_path, n_questions=2, n_annotated=2)
    anns = json.loads((tmp_path / "v2_annotations.json").read_text())
    anns["annotations"][1]["answer_type"] = ["yes/no"]  # the breakdown key must be one label
    (tmp_path / "v2_annotations.json").write_text(json.dumps(anns))
    with pytest.raises(DataError, match=r"annotations\[1\]: answer_type must be a string"):
        VQAv2Task().load(tmp_path)
    del anns["annotations"][1]["answer_type"]  # absent: scored, left out of perAnswerType
    (tmp_path / "v2_annotations.json").write_text(json.dumps(anns))
    (tmp_path / "preds.json").write_text(
        json.dumps([{"question_id": 100 + i, "answer": "no"} for i in range(2)])
    )
    s = score_file("vqav2", tmp_path, tmp_path / "preds.json")["scores"]
    assert s["num_questions"] == 2


@pytest.mark.parametrize("task, name", [("vqav2", "v2_questions.json"), ("pope", "pope.jsonl"),
                                        ("mmbench", "mmbench_dev.tsv"), ("textvqa", "TextVQA_val.json")])  # fmt: skip
def test_non_utf8_data_file_is_a_data_error(tmp_path, task, name):
    rows = {
        "vqav2": {"questions": [{"question_id": 1, "image_id": 1, "question": "Café?"}]},
        "pope": {"question_id": 1, "image": "a.jpg", "text": "Café?", "label": "yes"},
        "textvqa": {"data": [{"question_id": 1, "question": "Café?", "image_id": "a", "answers": ["x"] * 10}]},
    }  # fmt: skip
    text = (
        "index\tquestion\tA\tB\tanswer\timage\n0\tCafé?\tx\ty\tA\tiVBOR\n"
        if task == "mmbench"
        else json.dumps(rows[task], ensure_ascii=False)
    )
    (tmp_path / name).write_bytes(text.encode("latin-1"))  # "é" is the byte 0xe9, not UTF-8
    with pytest.raises(DataError, match=f"{name} is not UTF-8 text \\(byte 0xe9 at offset"):
        get_task(task).load(tmp_path if task == "vqav2" else tmp_path / name)


# ---------------------------------------------------------------- POPE


def _pope_items(labels):
    return [
        Item(id=str(i), prompt="", image=lambda: None, meta={"label": lab, "category": "random"})
        for i, lab in enumerate(labels)
    ]


def test_pope_missing_answer_is_wrong_and_zero_division_is_named():
    # two yes questions have no answer; the no question is answered "No"
    s = POPETask().score(_pope_items(["yes", "yes", "no"]), {"2": "No"})
    assert (s["TP"], s["FP"], s["TN"], s["FN"]) == (0, 0, 1, 2)
    assert s["accuracy"] == pytest.approx(100 / 3)
    assert s["recall"] == 0.0
    assert s["precision"] is None and s["f1"] is None  # eval_pope would divide by TP + FP = 0
    assert "precision: no question was answered yes (TP + FP = 0)" in s["undefined"]
    assert s["mean_over_categories"]["f1"] is None
    assert s["num_missing_predictions"] == 2


def test_pope_answers_that_match_no_question_are_an_error(tmp_path):
    # the coco_pope folder layout (ids "<category>/<question_id>") with LLaVA's answers file (no category)
    rows = [{"question_id": i, "image": "a.jpg", "text": "Is there a dog?", "label": "yes"} for i in (1, 2)]
    (tmp_path / "coco_pope_random.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    answers = [
        {"question_id": 1, "prompt": "Is there a dog?", "text": "No"},
        {"question_id": 2, "text": "No"},
    ]
    (tmp_path / "answers.jsonl").write_text("\n".join(json.dumps(a) for a in answers) + "\n")
    with pytest.raises(DataError, match='none of its 2 answers names a question.*"category"'):
        score_file("pope", tmp_path, tmp_path / "answers.jsonl")


def test_a_pope_answers_error_names_the_files_own_line(tmp_path):
    # blank lines count: the error names the line an editor shows, as the data file's errors do
    rows = [{"question_id": i, "image": "a.jpg", "text": "Is there a dog?", "label": "yes"} for i in (1, 2)]
    (tmp_path / "coco_pope_random.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    text = (
        json.dumps({"question_id": 1, "category": "random", "text": "No"})
        + "\n\n"
        + json.dumps({"question_id": 2})
    )
    (tmp_path / "answers.jsonl").write_text(text + "\n")
    with pytest.raises(DataError, match='answers.jsonl, line 3: needs "question_id" and "text"'):
        score_file("pope", tmp_path, tmp_path / "answers.jsonl")


# ---------------------------------------------------------------- MMBench


def _mmb_tsv(tmp_path, rows, header="index\tquestion\tA\tB\tC\tanswer\tcategory\timage"):
    (tmp_path / "mmbench_dev.tsv").write_text(header + "\n" + "\n".join("\t".join(r) for r in rows) + "\n")
    return tmp_path / "mmbench_dev.tsv"


def test_mmbench_options_none_are_kept_and_a_missing_answer_option_still_scores(tmp_path):
    data = _mmb_tsv(
        tmp_path,
        [
            ["0", "Which?", "cat", "dog", "none", "C", "c1", "iVBOR"],  # "none" is text to pandas
            ["1", "Which?", "cat", "dog", "NaN", "C", "c1", "iVBOR"],  # "NaN" is a missing cell
        ],
    )
    items = MMBenchTask().load(data)
    assert items[0].meta["choices"] == {"A": "cat", "B": "dog", "C": "none"}
    assert items[1].meta["choices"] == {"A": "cat", "B": "dog"}
    s = MMBenchTask().score(items, {"0": "none", "1": "C"})
    assert s["circular_accuracy"] == 100.0  # "none" matches option C's text; "C" is the answer letter


def test_mmbench_predictions_read_as_pandas_reads_them(tmp_path):
    data = _mmb_tsv(
        tmp_path,
        [
            ["0", "Who?", "Nan", "Bob", "Eve", "A", "c1", "iVBOR"],  # "Nan" is a name, not a missing value
            ["1", "Which?", "cat", "none", "dog", "B", "c1", "iVBOR"],
        ],
    )
    items = MMBenchTask().load(data)
    # the official scorer reads an empty / "N/A" / "null" / "None" cell as NaN and takes str() -> "nan":
    # the text "nan" contains option A of question 0 ("Nan"), and no longer contains "none" for question 1
    for cell in ("", "N/A", "null", "None"):
        (tmp_path / "preds.tsv").write_text(f"index\tprediction\n0\t{cell}\n1\t{cell}\n")
        preds = MMBenchTask().read_predictions(tmp_path / "preds.tsv", items)
        assert preds == {"0": "nan", "1": "nan"}
        s = MMBenchTask().score(items, preds)
        assert s["circular_accuracy"] == 50.0 and s["per_category"] == {"c1": 50.0}
    assert MMBenchTask().score(items, {"0": "Eve", "1": "None"})["circular_accuracy"] == 50.0


def test_mmbench_failed_api_answer_is_not_read_as_a_letter():
    choices = {"A": "cat", "B": "dog"}
    assert extract_answer("Failed to obtain answer via API. B", dict(choices)) is None
    assert (
        extract_answer("Failed to obtain answer via API: the dog", dict(choices)) == "B"
    )  # text still counts


def test_mmbench_question_without_its_main_prediction_is_dropped_and_counted(tmp_path):
    rows = []
    for q in (1, 2):
        for k in range(2):
            rows.append([str(q + k * 1_000_000), "Which?", "cat", "dog", "eel", "AB"[k], "c1", "iVBOR"])
    items = MMBenchTask().load(_mmb_tsv(tmp_path, rows))
    # question 1 answered fully and right; question 2 only in its rotation (its main row is missing)
    preds = {"1": "A", "1000001": "B", "1000002": "B"}
    s = MMBenchTask().score(items, preds)
    assert s["num_questions"] == 1 and s["num_questions_dropped"] == 1
    assert s["circular_accuracy"] == 100.0
    # a rotation without a prediction is not scored, as the official scorer walks the predicted rows
    s = MMBenchTask().score(items, {"1": "A", "2": "A"})
    assert s["circular_accuracy"] == 100.0 and s["num_rotations_without_prediction"] == 2


# ---------------------------------------------------------------- TextVQA


def test_textvqa_question_without_ten_answers_is_an_error(tmp_path):
    entry = {"question_id": 7, "question": "what brand?", "image_id": "abc", "answers": ["nikon"] * 9}
    (tmp_path / "TextVQA_val.json").write_text(json.dumps({"data": [entry]}))
    with pytest.raises(DataError, match=r"data\[0\] \(question_id 7\): needs a list of 10 answers"):
        TextVQATask().load(tmp_path / "TextVQA_val.json")
