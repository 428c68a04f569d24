"""The task registry: each task declares its labels, data options, bundled dev sets and prompt in its own file,
and the command line, `mm-oval score` and the demo read them from there. Adding a task is a class and one
registry line (shown here with a toy task registered for one test)."""

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from mm_oval.eval import cli_eval, cli_score, tasks
from mm_oval.eval.tasks import TASKS, DataOption, Item, Rule, Task, all_tasks, get_task, resolve_data

from mm_oval.cli import main
from mm_oval.errors import DataError
from mm_oval.zoo import bundled576_data_dir, bundled_data_dir

# the data flags the command line had before they were declared by the tasks; they stay
FLAGS = {"questions": "--questions", "annotations": "--annotations", "images": "--images",
         "image_map": "--image-map", "ocr": "--ocr"}  # fmt: skip


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


def test_every_task_declares_what_the_command_line_and_the_demo_read():
    for task in all_tasks():
        assert task.name in TASKS and task.title and task.metric_label and task.data_help
        assert task.predictions_format and task.rules and callable(task.prompt)
        assert all(isinstance(o, DataOption) for o in task.data_options)
        for name, folder in task.bundled.items():
            assert resolve_data(name, task) == folder()
        assert task.modality in ("image", "text")
    labels = {t.name: t.metric_label for t in all_tasks()}
    assert {k: labels[k] for k in ("vqav2", "mmbench", "pope", "textvqa", "objlist")} == {
        "vqav2": "VQAv2 acc", "mmbench": "MMBench circular", "pope": "POPE F1",
        "textvqa": "TextVQA acc", "objlist": "object list F1"}  # fmt: skip
    assert labels["passkey_1k"] == "passkey_1k acc" and get_task("passkey_1k").modality == "text"


def test_the_data_flags_and_their_options_are_the_ones_before():
    for module in (cli_eval, cli_score):
        parser = _parser(module)
        flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
        for name, flag in FLAGS.items():
            assert flags[name] == flag
        base = ["--task", "vqav2", "--data", "d", "--out", "o"]
        if module is cli_score:
            base += ["--predictions", "p"]
        else:
            base += ["--model", "m"]
        args = parser.parse_args([*base, "--image-map", "m.json", "--ocr", "ocr.json"])
        # the loader's keywords (and run.json's data_options) are what they were, in the same order
        assert cli_eval.data_options(args) == {"questions": None, "annotations": None, "images": None,
                                               "image_map": "m.json", "ocr": "ocr.json"}  # fmt: skip
        assert list(cli_eval.data_options(args)) == list(FLAGS)


def test_bundled_sets_are_the_tasks_own():
    assert resolve_data("bundled", get_task("vqav2")) == bundled_data_dir()
    assert resolve_data("bundled576", get_task("objlist")) == bundled576_data_dir()
    assert resolve_data("bundled") == bundled_data_dir()  # without a task: the folder, as before
    with pytest.raises(DataError, match="objlist has no bundled dev set 'bundled'.*bundled576"):
        resolve_data("bundled", get_task("objlist"))
    with pytest.raises(DataError, match="textvqa has no bundled dev set 'bundled576'"):
        resolve_data("bundled576", get_task("textvqa"))


def test_the_demo_refuses_a_task_without_a_bundled_set_before_loading(capsys):
    assert main(["demo", "--bench", "64", "--tasks", "objlist", "--methods", "snapkv"]) == 2
    assert "objlist has no bundled dev set 'bundled'" in capsys.readouterr().err


def test_textvqa_prompt_with_and_without_ocr_tokens():
    prompt = get_task("textvqa").prompt
    short = "Answer the question using a single word or phrase."
    assert prompt("what is written ?") == f"what is written ?\n{short}"
    assert prompt("q ?", ["stop", "sign"]) == f"q ?\nReference OCR token: stop, sign\n{short}"
    assert prompt("q ?", []) == f"q ?\nReference OCR token: \n{short}"


# ---- adding a task: this class and one registry line


class ToyTask(Task):
    name = "toy"
    title = "Toy"
    metric_label = "toy acc"
    primary_metric = "accuracy"
    data_help = "toy.jsonl"
    data_options = (DataOption("toy_notes", "notes file"),)
    predictions_format = 'JSONL rows {"question_id", "text"}'
    rules = (Rule("toy-v1", "mm-oval", "v1", "tests/test_eval_tasks.py", "exact match"),)

    @staticmethod
    def prompt(question: str) -> str:
        return f"{question}\nAnswer in one word."

    def load(
        self, data: Path, limit: int | None = None, toy_notes: str | None = None, **_: Any
    ) -> list[Item]:
        rows = [json.loads(x) for x in data.read_text().splitlines()][:limit]
        return [Item(str(r["id"]), self.prompt(r["q"]), lambda: None, {"answer": r["a"]}) for r in rows]

    def score(self, items, predictions, rules=None):
        hits = [predictions.get(it.id, "").strip() == it.meta["answer"] for it in items]
        return {"accuracy": round(100 * sum(hits) / len(hits), 2), "rules": self.rule(rules).record()}

    def read_predictions(self, path, items):
        return {str(r["question_id"]): r["text"] for r in map(json.loads, path.read_text().splitlines())}

    def write_predictions(self, path, items, predictions):
        path = path.with_suffix(".jsonl")
        path.write_text(
            "".join(json.dumps({"question_id": k, "text": v}) + "\n" for k, v in predictions.items())
        )
        return path


def test_a_new_task_is_one_class_and_one_registry_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(tasks.TASKS, "toy", f"{__name__}:ToyTask")
    help_text = _parser(cli_eval).format_help()
    assert "--toy-notes" in help_text and "Toy: notes file" in help_text and "toy-v1" in help_text
    data = tmp_path / "toy.jsonl"
    data.write_text('{"id": 1, "q": "2 + 2 ?", "a": "4"}\n{"id": 2, "q": "3 + 3 ?", "a": "6"}\n')
    preds = tmp_path / "preds.jsonl"
    preds.write_text('{"question_id": "1", "text": "4"}\n{"question_id": "2", "text": "5"}\n')
    assert main(["score", "--task", "toy", "--data", str(data), "--predictions", str(preds)]) == 0
    assert "toy: accuracy = 50.00" in capsys.readouterr().out
    assert get_task("toy").load(data)[0].prompt == "2 + 2 ?\nAnswer in one word."
