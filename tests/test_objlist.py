"""The object-list task: its rule on hand-worked answers, the data checks and their messages, the
answers file, and the eval / score / sweep commands end to end on the bundled tiny model."""

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mm_oval.eval.objlist import ObjListTask, score_prediction, split_items
from mm_oval.eval.runner import evaluate, load_model, score_file
from mm_oval.eval.tasks import Item, get_task

from mm_oval.cli import main
from mm_oval.errors import DataError
from mm_oval.prompts import LIST_INSTRUCTION, list_prompt
from mm_oval.zoo import bundled_data_dir
from mm_oval.zoo.vocab import COLORS, SHAPES

pytestmark = pytest.mark.usefixtures("one_thread")

LTR = "what are the objects from left to right ?"
TTB = "what are the objects from top to bottom ?"
REF3 = ["red circle", "blue square", "green cross"]


def _row(qid, answer=("red circle", "blue square"), order="left to right", image=None, **extra):
    row = {
        "question_id": qid,
        "image": image or f"COCO_val2014_{qid:012d}.png",
        "question": LTR if order == "left to right" else TTB,
        "answer": list(answer),
        "order": order,
    }
    return {**row, **extra}


def _write(root: Path, rows: list, images=(1, 2, 3)) -> Path:
    """A list_dev.jsonl of `rows` (dicts, or raw lines) in `root`, with the bundled images `images`."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for i in images:
        name = f"COCO_val2014_{i:012d}.png"
        shutil.copy(bundled_data_dir() / "images" / name, root / "images" / name)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    (root / "list_dev.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _items(rows: list[dict]) -> list[Item]:
    return [
        Item(id=str(r["question_id"]), prompt="", image=lambda: None,
             meta={"question_id": r["question_id"], "answer": r["answer"], "order": r["order"]})
        for r in rows
    ]  # fmt: skip


# ---------------------------------------------------------------- the rule, by hand


@pytest.mark.parametrize(
    "prediction, reference, f1, precision, recall, exact, order",
    [
        # the tiny model's decoding (spaces around commas) and a real model's
        ("red circle , blue square , green cross", REF3, 1, 1, 1, 1, 1),
        ("Red circle, blue square, green cross.", REF3, 1, 1, 1, 1, 1),
        # swapped order: every item found, order broken; LCS keeps 2 of 3
        ("blue square, red circle, green cross", REF3, 1, 1, 1, 0, 2 / 3),
        ("green cross, blue square, red circle", REF3, 1, 1, 1, 0, 1 / 3),
        # a duplicate in the prediction matches only once
        ("red circle, red circle, blue square", ["red circle", "blue square"], 0.8, 2 / 3, 1, 0, 1),
        # a duplicate in the reference needs two predicted copies
        ("red circle", ["red circle", "red circle"], 2 / 3, 1, 0.5, 0, 0.5),
        ("red circle, red circle", ["red circle", "red circle"], 1, 1, 1, 1, 1),
        # an extra item costs precision, a missing one recall
        ("red circle, blue square, pink cross", ["red circle", "blue square"], 0.8, 2 / 3, 1, 0, 1),
        ("red circle", REF3, 0.5, 1, 1 / 3, 0, 1 / 3),
        # "and" between items, with and without the serial comma
        ("red circle, blue square and green cross", REF3, 1, 1, 1, 1, 1),
        ("red circle, blue square, and green cross", REF3, 1, 1, 1, 1, 1),
        ("red circle and blue square and green cross", REF3, 1, 1, 1, 1, 1),
        # articles and surrounding punctuation go, inner whitespace collapses
        ("a red circle;, the  blue square!, an green cross .", REF3, 1, 1, 1, 1, 1),
        # a ';' inside is not a separator: "red circle; blue square" is one (wrong) item
        ("red circle; blue square", ["red circle", "blue square"], 0, 0, 0, 0, 0),
        ("The red circle", ["red circle"], 1, 1, 1, 1, 1),
        ("A red circle, blue square and the green cross.", REF3, 1, 1, 1, 1, 1),
        # an empty prediction, or one of separators only, scores 0 (precision too)
        ("", REF3, 0, 0, 0, 0, 0),
        (" , and . ", REF3, 0, 0, 0, 0, 0),
        ("green", REF3, 0, 0, 0, 0, 0),
        # other punctuation is part of the item: "red circle?" is not "red circle"
        ("red circle?", ["red circle"], 0, 0, 0, 0, 0),
    ],
)
def test_hand_worked_answers(prediction, reference, f1, precision, recall, exact, order):
    got = score_prediction(prediction, reference)
    assert got == pytest.approx(
        {"f1": f1, "precision": precision, "recall": recall, "exact_order": exact, "order_score": order}
    )


def test_splitting_keeps_and_inside_words_and_the_article_when_it_is_the_item():
    assert split_items("sandy square, black-and-white circle") == ["sandy square", "black-and-white circle"]
    assert split_items("red circle AND blue square") == ["red circle", "blue square"]
    assert split_items("a, the red circle") == ["a", "red circle"]  # a lone "a" is an item, not an article
    assert split_items(" , , ") == [] and split_items("red\n circle") == ["red circle"]


def test_aggregate_means_by_order_and_missing_predictions():
    rows = [
        _row(1, REF3),
        _row(2, ["red circle", "blue square"], order="top to bottom"),
        _row(3, ["green cross"], order="top to bottom"),
    ]
    # q1: swapped pair (F1 1, exact 0, order 2/3); q2: one of two (P 1, R .5, F1 2/3, order .5); q3: none
    preds = {"1": "blue square, red circle, green cross", "2": "blue square"}
    s = ObjListTask().score(_items(rows), preds)
    assert s["f1"] == round(100 * (1 + 2 / 3 + 0) / 3, 2) == 55.56
    assert s["precision"] == round(100 * (1 + 1) / 3, 2) == 66.67
    assert s["recall"] == 50.0 and s["exact_order"] == 0.0
    assert s["order_score"] == round(100 * (2 / 3 + 0.5) / 3, 2) == 38.89
    assert s["count"] == 3 and s["num_missing_predictions"] == 1
    assert s["by_order"]["left to right"] == {
        "f1": 100.0, "precision": 100.0, "recall": 100.0, "exact_order": 0.0, "order_score": 66.67, "count": 1
    }  # fmt: skip
    assert s["by_order"]["top to bottom"]["f1"] == 33.33 and s["by_order"]["top to bottom"]["count"] == 2
    assert s["rules"]["name"] == "objlist-v1" and s["rules"]["source"]["file"] == "eval/objlist.py"
    assert ObjListTask().primary(s) == 55.56


# ---------------------------------------------------------------- properties

item = st.tuples(st.sampled_from(COLORS), st.sampled_from(SHAPES)).map(" ".join)
references = st.lists(item, min_size=1, max_size=6)
SETTINGS = settings(max_examples=60, derandomize=True, deadline=None, database=None)


@SETTINGS
@given(references, st.sampled_from([" , ", ", ", ",", " and "]), st.sampled_from(["", "a ", "the "]),
       st.sampled_from(["", ".", " ."]), st.booleans())  # fmt: skip
def test_the_reference_itself_scores_100_however_it_is_written(ref, sep, article, end, upper):
    text = sep.join(article + r for r in ref) + end
    s = ObjListTask().score(_items([_row(1, ref)]), {"1": text.upper() if upper else text})
    assert s["f1"] == s["precision"] == s["recall"] == s["exact_order"] == s["order_score"] == 100.0


@SETTINGS
@given(references, st.randoms(use_true_random=False))
def test_a_permutation_keeps_f1_and_breaks_exact_order_when_it_changes_the_list(ref, rnd):
    perm = list(ref)
    rnd.shuffle(perm)
    got = score_prediction(", ".join(perm), ref)
    assert got["f1"] == got["precision"] == got["recall"] == 1.0
    assert got["exact_order"] == float(perm == ref)
    assert (got["order_score"] == 1.0) == (perm == ref)


# ---------------------------------------------------------------- data and its checks


def test_load_builds_the_list_prompt_and_finds_the_images(tmp_path):
    data = _write(tmp_path, [_row(1), _row(2, order="top to bottom"), "", _row(3, ["pink cross"])])
    items = get_task("objlist").load(data)
    assert LIST_INSTRUCTION == "List each object by its color and shape, separated by commas."
    assert [it.id for it in items] == ["1", "2", "3"]
    assert items[0].prompt == f"{LTR}\n{LIST_INSTRUCTION}" == list_prompt(LTR)
    assert items[1].meta["order"] == "top to bottom" and items[2].meta["answer"] == ["pink cross"]
    assert items[0].image().size[0] > 0
    # the file itself works too, and --limit keeps the first N
    assert [it.id for it in ObjListTask().load(data / "list_dev.jsonl", limit=2)] == ["1", "2"]
    assert ObjListTask.max_new_tokens >= 40  # a list of several objects, not a short answer


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"answer": None}, "missing field 'answer'"),
        ({"order": None, "image": None}, "missing field 'image', 'order'"),
        ({"answer": "red circle"}, "answer 'red circle' is not a non-empty list"),
        ({"answer": []}, "answer [] is not a non-empty list"),
        ({"answer": ["red circle", 3]}, "answer item 3 is not text"),
        ({"answer": ["red circle, blue square"]}, "would be split by the scoring rule"),
        ({"answer": ["red and blue circle"]}, "would be split by the scoring rule"),
        ({"answer": [" . "]}, "is empty"),
        ({"question_id": "2"}, "question_id '2' is not an integer"),
        ({"question_id": True}, "question_id True is not an integer"),
        ({"question": ""}, "question '' is not a non-empty text"),
        ({"order": "right to left"}, "order 'right to left' is not one of 'left to right', 'top to bottom'"),
        ({"image": "COCO_val2014_000000000099.png"}, "000099.png not found; put the images in"),
    ],
)
def test_a_bad_row_names_the_file_the_line_and_what_to_do(tmp_path, bad, message):
    row = _row(2)
    for k, v in bad.items():
        row.pop(k) if v is None else row.__setitem__(k, v)
    # a blank line before the bad row: the line number is the file's, not the row's
    _write(tmp_path, [_row(1), "", row])
    with pytest.raises(DataError) as e:
        ObjListTask().load(tmp_path)
    assert "list_dev.jsonl, line 3: " in str(e.value) and message in str(e.value)


def test_repeated_ids_empty_files_and_missing_files_are_data_errors(tmp_path):
    _write(tmp_path, [_row(1), _row(2), _row(1, image="COCO_val2014_000000000003.png")])
    with pytest.raises(DataError, match=r"line 3: question_id 1 repeats line 1"):
        ObjListTask().load(tmp_path)
    (tmp_path / "list_dev.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no questions"):
        ObjListTask().load(tmp_path)
    (tmp_path / "list_dev.jsonl").write_text('{"question_id": 1,\n')
    with pytest.raises(DataError, match="list_dev.jsonl, line 1: not valid JSON"):
        ObjListTask().load(tmp_path)
    (tmp_path / "list_dev.jsonl").unlink()
    with pytest.raises(DataError, match="no object-list file in"):
        ObjListTask().load(tmp_path)


def test_answers_file_errors(tmp_path):
    data = _write(tmp_path, [_row(1), _row(2)])
    items = ObjListTask().load(data)
    answers = tmp_path / "answers.jsonl"
    for lines, message in (
        (['{"question_id": 1}'], 'line 1: needs "question_id" and "text"'),
        (['{"question_id": 1, "text": ["red circle"]}'], "line 1: text ['red circle'] is not text"),
        (['{"question_id": 1, "text": "a"}', "", '{"question_id": 1, "text": "b"}'],
         "line 3: a second answer to question 1"),
        (['{"question_id": 7, "text": "a"}'], "none of its 1 answers names a question"),
    ):  # fmt: skip
        answers.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]")):
            ObjListTask().read_predictions(answers, items)
    # answers for other questions are ignored; string ids match integer ones
    answers.write_text('{"question_id": "2", "text": "red circle"}\n{"question_id": 9, "text": "x"}\n')
    assert ObjListTask().read_predictions(answers, items) == {"2": "red circle"}


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(
    st.sampled_from(["question_id", "image", "question", "answer", "order"]),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
        max_leaves=6,
    ),
)
def test_any_value_in_any_field_loads_or_is_a_data_error(tmp_path_factory, key, value):
    root = tmp_path_factory.mktemp("fuzz")
    _write(root, [{**_row(1), key: value}], images=(1,))
    try:
        items = ObjListTask().load(root)
    except DataError:
        return
    s = ObjListTask().score(items, {"1": "red circle"})
    assert 0 <= s["f1"] <= 100


# ---------------------------------------------------------------- end to end on the bundled tiny model


@pytest.fixture(scope="module")
def bundled():
    return load_model("bundled", device="cpu")


@pytest.fixture(scope="module")
def list_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("objlist")
    return _write(root, [_row(1, REF3), _row(2, order="top to bottom"), _row(3, ["yellow triangle"])])


def test_eval_resume_and_score_roundtrip_on_the_bundled_model(bundled, list_dir, tmp_path, capsys):
    model, processor = bundled
    out = tmp_path / "run"
    res = evaluate(model, processor, "objlist", list_dir, out_dir=out, progress=False)
    assert res["task"] == "objlist" and res["primary_metric"] == "f1"
    assert res["config"]["max_new_tokens"] == ObjListTask.max_new_tokens  # the task's, not the short 16
    assert res["counts"] == {**res["counts"], "items": 3, "predictions": 3, "missing": 0}
    assert set(res["scores"]["by_order"]) == {"left to right", "top to bottom"}
    saved = json.loads((out / "results.json").read_text())
    assert saved["scores"] == res["scores"] and saved["official_predictions"] == "predictions_official.jsonl"
    official = [json.loads(x) for x in (out / "predictions_official.jsonl").read_text().splitlines()]
    assert [r["question_id"] for r in official] == [1, 2, 3] and all(
        isinstance(r["text"], str) for r in official
    )
    # a rerun with the same folder generates nothing and scores the same
    again = evaluate(model, processor, "objlist", list_dir, out_dir=out, progress=False)
    assert again["run"]["new_items"] == 0 and again["scores"] == res["scores"]
    # `mm-oval score` on the official file gives the run's scores
    assert score_file("objlist", list_dir, out / "predictions_official.jsonl")["scores"] == res["scores"]
    # and on a hand-written answers file: q1 exact, q2 swapped, q3 missing
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        '{"question_id": 1, "text": "red circle , blue square , green cross"}\n'
        '{"question_id": 2, "text": "Blue square and a red circle."}\n'
    )
    scored = tmp_path / "scored.json"
    argv = ["score", "--task", "objlist", "--data", str(list_dir), "--predictions", str(answers)]
    assert main(argv + ["--out", str(scored)]) == 0
    printed = capsys.readouterr().out
    assert "objlist: f1 = 66.67" in printed and "rules: objlist-v1 (mm-oval @ v1, eval/objlist.py)" in printed
    assert "2 of 3 questions have a prediction" in printed
    s = json.loads(scored.read_text())["scores"]
    assert (s["exact_order"], s["order_score"], s["num_missing_predictions"]) == (33.33, 50.0, 1)
    assert s["by_order"]["top to bottom"] == {
        "f1": 100.0, "precision": 100.0, "recall": 100.0, "exact_order": 0.0, "order_score": 50.0, "count": 1
    }  # fmt: skip


def test_eval_and_sweep_commands_on_the_bundled_model(list_dir, tmp_path, capsys):
    common = ["--model", "bundled", "--task", "objlist", "--data", str(list_dir), "--limit", "2",
              "--max-new-tokens", "8", "--no-progress"]  # fmt: skip
    assert main(["eval", *common, "--out", str(tmp_path / "eval")]) == 0
    assert "objlist: f1 = " in capsys.readouterr().out
    assert (
        main(
            ["sweep", *common, "--methods", "streamingllm", "--budgets", "0.5", "--out", str(tmp_path / "sw")]
        )
        == 0
    )
    summary = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert summary["task"] == "objlist" and summary["primary_metric"] == "f1"
    assert summary["rules"]["name"] == "objlist-v1" and len(summary["cells"]) == 1
    assert "objlist: f1 by KV budget" in (tmp_path / "sw" / "sweep.md").read_text()
    # a bad data file stops the command with a message, not a traceback
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "list_dev.jsonl").write_text(json.dumps(_row(1, answer=[])) + "\n")
    rc = main(["eval", *common[:5], str(tmp_path / "bad"), "--out", str(tmp_path / "e2"), "--no-progress"])
    assert rc == 2 and "line 1: answer [] is not a non-empty list" in capsys.readouterr().err
    assert not (tmp_path / "e2" / "run.json").exists()
