"""The sweep (grid, table, plot, resume) and the eval / score / sweep commands end to end."""

import json

import pytest
from mm_oval.eval.sweep import cell_dir_name, markdown_table, parse_budgets, parse_methods, run_sweep
from mm_oval.eval.vqa import VQAv2Task

import mm_oval
from mm_oval.cli import main
from mm_oval.errors import ConfigError


def _vqa(root):
    from PIL import Image

    (root / "images").mkdir(parents=True)
    qs, anns = [], []
    for i, color in enumerate(["red", "blue", "green"]):
        Image.new("RGB", (128, 128), color).save(root / "images" / f"COCO_val2014_{i + 1:012d}.png")
        qs.append({"question_id": 10 + i, "image_id": i + 1, "question": "what color is the image ?"})
        anns.append(
            {
                "question_id": 10 + i,
                "image_id": i + 1,
                "question_type": "what color",
                "answer_type": "other",
                "answers": [
                    {"answer": color, "answer_confidence": "yes", "answer_id": k} for k in range(1, 11)
                ],
            }
        )
    (root / "q_questions.json").write_text(json.dumps({"questions": qs}))
    (root / "a_annotations.json").write_text(json.dumps({"annotations": anns}))
    return root


def test_method_and_budget_lists():
    assert parse_methods(["snapkv,knorm", "kvp:agents=x.safetensors,scope=all"]) == [
        "snapkv",
        "knorm",
        "kvp:agents=x.safetensors,scope=all",
    ]
    assert parse_budgets(["0.1,0.25", "64"]) == [0.1, 0.25, 64]
    with pytest.raises(ConfigError):
        parse_budgets(["a quarter"])
    assert cell_dir_name("kvp:scope=all", 0.25) == "kvp_scope=all@0.25"


def test_sweep_writes_table_and_plot_and_resumes(tiny_random_llava, tmp_path):
    model, processor = tiny_random_llava
    data = _vqa(tmp_path / "data")
    kw = {"max_new_tokens": 3, "progress": False, "batch_size": 3}
    s = run_sweep(
        model, processor, "vqav2", data, ["streamingllm", "knorm"], [0.25, 0.5], tmp_path / "sw", **kw
    )
    assert len(s["cells"]) == 4 and s["full"] is not None
    table = (tmp_path / "sw" / "sweep.md").read_text()
    assert "| full |" in table and "| streamingllm |" in table and "| knorm |" in table
    png = (tmp_path / "sw" / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # compressed cells report the KV kept; a smaller budget keeps less
    kept = {(c["method"], c["budget"]): c["kv_fraction_kept"] for c in s["cells"]}
    assert kept[("knorm", 0.25)] < kept[("knorm", 0.5)] < 1.0
    assert not mm_oval.is_wrapped(model)  # the sweep leaves the model unwrapped
    # a rerun generates nothing new and gives the same table
    again = run_sweep(
        model, processor, "vqav2", data, ["streamingllm", "knorm"], [0.25, 0.5], tmp_path / "sw", **kw
    )
    assert again["cells"] == s["cells"]
    for c in s["cells"]:
        r = json.loads((tmp_path / "sw" / c["dir"] / "results.json").read_text())
        assert r["run"]["new_items"] == 0


def test_commands_eval_then_score(tiny_random_llava, tmp_path, capsys):
    model, processor = tiny_random_llava
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    data = _vqa(tmp_path / "data")
    rc = main(["eval", "--model", str(tmp_path / "m"), "--task", "vqav2", "--data", str(data), "--out",
               str(tmp_path / "out"), "--max-new-tokens", "3", "--batch-size", "2", "--dtype", "float32", "--no-progress"])  # fmt: skip
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    # another toolkit's results file in the official format: two right, one wrong
    theirs = [
        {"question_id": 10, "answer": "Red"},
        {"question_id": 11, "answer": "blue."},
        {"question_id": 12, "answer": "x"},
    ]
    (tmp_path / "theirs.json").write_text(json.dumps(theirs))
    rc = main(["score", "--task", "vqav2", "--data", str(data), "--predictions", str(tmp_path / "theirs.json"),
               "--out", str(tmp_path / "scored")])  # fmt: skip
    assert rc == 0
    scored = json.loads((tmp_path / "scored" / "results.json").read_text())
    assert scored["scores"]["overall"] == round(100 * 2 / 3, 2)
    assert "overall = 66.67" in capsys.readouterr().out
    # our own official file scores exactly as the run did
    rc = main(["score", "--task", "vqav2", "--data", str(data), "--predictions", str(tmp_path / "out" / "predictions_official.json")])  # fmt: skip
    assert rc == 0 and f"overall = {res['primary']:.2f}" in capsys.readouterr().out
    # errors a user can cause end with a message and exit code 2, not a traceback
    rc = main(["score", "--task", "vqav2", "--data", str(tmp_path / "missing"), "--predictions", "x.json"])
    assert rc == 2 and "data path not found" in capsys.readouterr().err
    rc = main(["eval", "--model", str(tmp_path / "m"), "--task", "vqav2", "--data", str(data), "--out",
               str(tmp_path / "out"), "--max-new-tokens", "4", "--dtype", "float32", "--no-progress"])  # fmt: skip
    assert rc == 2 and "another configuration" in capsys.readouterr().err


def test_bundled_data_loads_in_every_format():
    from mm_oval.eval.mmbench import MMBenchTask
    from mm_oval.eval.pope import POPETask
    from mm_oval.eval.tasks import resolve_data

    try:
        data = resolve_data("bundled")
    except Exception as e:  # the bundled sets are generated by the zoo; skip only while they are absent
        pytest.skip(f"bundled data not available: {e}")
    for task in (MMBenchTask(), VQAv2Task(), POPETask()):
        items = task.load(data, limit=3)
        assert items and items[0].image().size[0] > 0


def test_vqav2_without_annotations_writes_a_submission_file(tiny_random_llava, tmp_path, capsys):
    from mm_oval.eval import evaluate

    model, processor = tiny_random_llava
    data = _vqa(tmp_path / "testdev")
    (data / "a_annotations.json").unlink()  # test-dev ships questions only
    res = evaluate(
        model, processor, "vqav2", data, max_new_tokens=3, out_dir=tmp_path / "out", progress=False
    )
    assert res["primary"] is None and res["scores"]["num_questions"] == 3
    submission = json.loads((tmp_path / "out" / "predictions_official.json").read_text())
    assert [r["question_id"] for r in submission] == [10, 11, 12]
    assert all(isinstance(r["answer"], str) for r in submission)


def test_sweep_checks_every_cell_before_the_first_runs(tiny_random_llava, tmp_path):
    model, processor = tiny_random_llava
    data = _vqa(tmp_path / "data")
    kw = {"max_new_tokens": 3, "progress": False}
    for methods, budgets, match in (
        (["streamingllm", "knorm:nosuchoption=1"], [0.5], "sweep cell knorm:nosuchoption=1 @ 0.5"),
        (["streamingllm"], [0.5, 1.5], "sweep cell streamingllm @ 1.5"),
    ):
        with pytest.raises(ConfigError, match=match):
            run_sweep(model, processor, "vqav2", data, methods, budgets, tmp_path / "sw", **kw)
        # nothing ran, so nothing was written: the corrected command is not refused
        assert not list((tmp_path / "sw").rglob("run.json")) and not list((tmp_path / "sw").rglob("*.jsonl"))
        assert not mm_oval.is_wrapped(model)
    s = run_sweep(model, processor, "vqav2", data, ["streamingllm"], [0.5], tmp_path / "sw", **kw)
    assert len(s["cells"]) == 1


def test_sweep_and_eval_name_the_scoring_rule(tiny_random_llava, tmp_path, capsys):
    model, processor = tiny_random_llava
    data = _vqa(tmp_path / "data")
    kw = {"max_new_tokens": 2, "progress": False, "limit": 2}
    with pytest.raises(ConfigError, match="unknown scoring rule 'x'"):
        run_sweep(model, processor, "vqav2", data, ["knorm"], [0.5], tmp_path / "bad", rules="x", **kw)
    assert not (tmp_path / "bad" / "full").exists()  # refused before the first cell
    s = run_sweep(model, processor, "vqav2", data, ["knorm"], [0.5], tmp_path / "sw", rules="vqaeval", **kw)
    assert s["rules"]["name"] == "vqaeval" and s["rules"]["source"]["repository"] == "GT-Vision-Lab/VQA"
    assert (
        "Scored with rule vqaeval (GT-Vision-Lab/VQA @ a013f0043c"
        in (tmp_path / "sw" / "sweep.md").read_text()
    )
    cell = json.loads((tmp_path / "sw" / s["cells"][0]["dir"] / "results.json").read_text())
    assert cell["scores"]["rules"]["name"] == "vqaeval"
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    rc = main(["eval", "--model", str(tmp_path / "m"), "--task", "vqav2", "--data", str(data), "--out",
               str(tmp_path / "out"), "--max-new-tokens", "2", "--limit", "2", "--dtype", "float32", "--no-progress"])  # fmt: skip
    assert rc == 0 and "rules: lmms-eval (EvolvingLMMs-Lab/lmms-eval @ 7548ebe" in capsys.readouterr().out


def test_sweep_plot_is_written_with_the_users_permissions(tmp_path):
    import os

    from mm_oval.eval.plots import plot_sweep

    cells = [{"method": f"m{i}:sink_tokens=3,window={i}", "budget": b, "primary": 50.0 + i} for i in range(3)
             for b in (0.1, 0.5)]  # fmt: skip
    old = os.umask(0o027)
    try:
        out = plot_sweep(cells, 60.0, tmp_path / "p" / "sweep.png", title="t", ylabel="y")
    finally:
        os.umask(old)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out.stat().st_mode & 0o777) == 0o640  # not tempfile's 0600
    assert [p.name for p in out.parent.iterdir()] == ["sweep.png"]  # no temporary file left


def test_the_table_says_which_methods_budget_is_a_read_budget():
    cells = [{"method": m, "budget": 0.25, "primary": 90.0} for m in ("snapkv", "quest:sink_tokens=3")]
    summary = {"task": "vqav2", "primary_metric": "overall", "budgets": [0.25], "full_ran": False,
               "methods": ["snapkv", "quest:sink_tokens=3"], "cells": cells}  # fmt: skip
    table = markdown_table(summary)
    assert "For quest:sink_tokens=3 (retrieval) the budget is `read_budget`" in table
    assert "snapkv (retrieval)" not in table and "snapkv" in table
    assert "read_budget" not in markdown_table({**summary, "methods": ["snapkv"], "cells": cells[:1]})
