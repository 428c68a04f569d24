"""Resuming an evaluation safely: the run identity (dtype, device, weights), one run per output folder,
damaged prediction files, arguments checked before anything is written, Ctrl-C, temporary files and
permissions of the results."""

import copy
import json
import os
import threading

import pytest
import torch
from mm_oval.eval import runner
from mm_oval.eval.runner import evaluate, load_model, score_file
from PIL import Image

import mm_oval
from mm_oval.cli import main
from mm_oval.errors import ConfigError, DataError, ResultsError

COLORS = ["red", "green", "blue", "yellow"]
KW = {"max_new_tokens": 4, "progress": False}


def make_vqav2(root):
    """Four images, one colour question each (worded two ways: two prompt lengths), in the VQAv2 layout."""
    (root / "images").mkdir(parents=True)
    qs, anns = [], []
    for i, color in enumerate(COLORS):
        Image.new("RGB", (64, 64), color).save(root / "images" / f"COCO_val2014_{i + 1:012d}.png")
        question = "what color is the image ?" if i % 2 == 0 else "color ?"
        qs.append({"question_id": 10 + i, "image_id": i + 1, "question": question})
        anns.append(
            {
                "question_id": 10 + i,
                "image_id": i + 1,
                "question_type": "what color",
                "answer_type": "other",
                "answers": [{"answer": color, "answer_confidence": "yes", "answer_id": k} for k in range(10)],
            }
        )
    (root / "q_questions.json").write_text(json.dumps({"questions": qs}))
    (root / "a_annotations.json").write_text(json.dumps({"annotations": anns}))
    return root


@pytest.fixture(scope="module")
def loaded(tiny_random_llava_dir):
    return load_model(str(tiny_random_llava_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_vqav2(tmp_path_factory.mktemp("vqa"))


def _eval_args(model_dir, data, out, *extra):
    return ["eval", "--model", str(model_dir), "--task", "vqav2", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "4", "--dtype", "float32", "--no-progress", *extra]  # fmt: skip


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "option, value",
    [("--limit", "-1"), ("--limit", "0"), ("--batch-size", "0"), ("--max-new-tokens", "0"),
     ("--multi-turn", "0"), ("--budget", "-0.5"), ("--budget", "nan"), ("--dtype", "float64")],
)  # fmt: skip
def test_eval_refuses_a_bad_number_before_loading_the_model(tmp_path, data, capsys, option, value):
    # the model path does not exist: the argument must be refused before anything tries to load it
    with pytest.raises(SystemExit) as exit_:
        main(_eval_args(tmp_path / "no-model", data, tmp_path / "out", option, value))
    assert exit_.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_score_limit_must_be_positive(data, tmp_path, capsys):
    """`score --limit -1` used to score all but the last question and `--limit 0` to print a score of
    nothing, both with exit status 0."""
    preds = tmp_path / "p.json"
    preds.write_text(json.dumps([{"question_id": 10 + i, "answer": c} for i, c in enumerate(COLORS)]))
    for bad in ("-1", "0"):
        with pytest.raises(SystemExit) as exit_:
            main(
                ["score", "--task", "vqav2", "--data", str(data), "--predictions", str(preds), "--limit", bad]
            )
        assert exit_.value.code == 2 and "argument --limit: must be >= 1" in capsys.readouterr().err
    for bad in (-1, 0):
        with pytest.raises(ConfigError, match="--limit must be a whole number >= 1"):
            score_file("vqav2", data, preds, limit=bad)
    assert score_file("vqav2", data, preds, limit=3)["counts"]["items"] == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [({"max_new_tokens": 0}, "--max-new-tokens"), ({"multi_turn": 0}, "--multi-turn"),
     ({"batch_size": 2.5}, "--batch-size")],
)  # fmt: skip
def test_evaluate_refuses_bad_counts(loaded, data, tmp_path, kwargs, match):
    model, processor = loaded
    with pytest.raises(ConfigError, match=match):
        evaluate(model, processor, "vqav2", data, out_dir=tmp_path, **{**KW, **kwargs})
    assert not (tmp_path / "run.json").exists()


def test_a_typo_in_the_method_writes_nothing_so_the_corrected_command_runs(loaded, data, tmp_path):
    model, processor = loaded
    out = tmp_path / "out"
    for method, budget in (
        ("streamingllm", 1.5),
        ("streamingllm:sink_tokens=-2", 0.5),
        ("nosuchmethod", 0.5),
    ):
        with pytest.raises(ConfigError):
            evaluate(
                model, processor, "vqav2", data, method=method, budget=budget, out_dir=out, limit=2, **KW
            )
        assert not (out / "run.json").exists(), method
        assert not mm_oval.is_wrapped(model)
    res = evaluate(
        model, processor, "vqav2", data, method="streamingllm", budget=0.5, out_dir=out, limit=2, **KW
    )
    assert res["counts"]["predictions"] == 2


# ---------------------------------------------------------------- identity


def test_resume_with_another_dtype_or_other_weights_is_refused(loaded, data, tmp_path, tiny_random_llava_dir):
    model, processor = loaded
    out = tmp_path / "out"
    first = evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, **KW)
    assert first["config"]["dtype"] == "float32" and first["config"]["device"] == "cpu"
    assert json.loads((out / "results.json").read_text())["config"]["dtype"] == "float32"
    # the same weights loaded again (or copied in memory) resume: the fingerprint is stable
    again, _ = load_model(str(tiny_random_llava_dir), device="cpu", dtype="float32")
    assert (
        runner.weights_fingerprint(again) == runner.weights_fingerprint(model) == first["config"]["weights"]
    )
    assert evaluate(again, processor, "vqav2", data, out_dir=out, limit=2, **KW)["run"]["new_items"] == 0

    half = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(ResultsError, match="dtype: 'float32' there, 'bfloat16' now"):
        evaluate(half, processor, "vqav2", data, out_dir=out, limit=2, **KW)

    tuned = copy.deepcopy(model)  # a model built in Python, its weights changed in place
    with torch.no_grad():
        tuned.lm_head.weight.mul_(1.01)
    with pytest.raises(ResultsError, match=r"weights\.tensors: '[0-9a-f]+' there, '[0-9a-f]+' now"):
        evaluate(tuned, processor, "vqav2", data, out_dir=out, limit=2, **KW)
    assert (out / "results.json").exists() and len(
        (out / "predictions.rank0.jsonl").read_text().splitlines()
    ) == 2


def test_a_changed_default_under_the_same_method_spec_is_refused(loaded, data, tmp_path, monkeypatch):
    """The identity holds the method with every default spelled out: if a version changes a default (here
    OVAL's rank, as page sizes and summary formats have changed), the same spec string no longer resumes
    the old predictions; a run.json of an older format (no resolved method) is refused by name."""
    import dataclasses

    from mm_oval.policies.pagebases import OvalRetrieval

    model, processor = loaded
    out = tmp_path / "out"
    spec = "oval:sink_tokens=0,recent_tokens=0"
    first = evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=spec, budget=0.5, **KW)
    ident = json.loads((out / "run.json").read_text())["identity"]
    assert ident["resolved"]["retrieval_options"]["rank"] == 8 and ident["resolved"]["read_budget"] == 0.5
    assert (
        ident["resolved"]["image_tile"] == 4
        and ident["resolved"]["retrieval_options"]["summary_format"] == "compact"
    )
    again = evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=spec, budget=0.5, **KW)
    assert again["run"]["new_items"] == 0 and again["primary"] == first["primary"]

    rank = {f.name: f for f in dataclasses.fields(OvalRetrieval)}["rank"]
    monkeypatch.setattr(rank, "default", 4)  # a version whose OVAL defaults to rank 4
    with pytest.raises(ResultsError, match=r"resolved\.retrieval_options\.rank: 8 there, 4 now"):
        evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=spec, budget=0.5, **KW)
    monkeypatch.undo()

    # a run recorded before a knob existed ran at the default that does what every run did then: it resumes
    added = ("read_head_budget", "read_chunks")
    before = ident | {"resolved": {k: v for k, v in ident["resolved"].items() if k not in added}}
    (out / "run.json").write_text(json.dumps({"identity": before}))
    again = evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=spec, budget=0.5, **KW)
    assert again["run"]["new_items"] == 0 and again["primary"] == first["primary"]
    shared = "oval:sink_tokens=0,recent_tokens=0,read_head_budget=shared"
    (out / "run.json").write_text(json.dumps({"identity": before | {"method": shared}}))
    with pytest.raises(ResultsError, match=r"resolved\.read_head_budget: None there, 'shared' now"):
        evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=shared, budget=0.5, **KW)
    dense = "oval:sink_tokens=0,recent_tokens=0,read_chunks=dense"
    (out / "run.json").write_text(json.dumps({"identity": before | {"method": dense}}))
    with pytest.raises(ResultsError, match=r"resolved\.read_chunks: None there, 'dense' now"):
        evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=dense, budget=0.5, **KW)

    old = {k: v for k, v in ident.items() if k != "resolved"} | {"format": 2}
    (out / "run.json").write_text(json.dumps({"identity": old}))
    with pytest.raises(ResultsError, match=r"format: 2 there, 3 now; resolved: not recorded there"):
        evaluate(model, processor, "vqav2", data, out_dir=out, limit=2, method=spec, budget=0.5, **KW)


def test_new_weights_saved_at_the_same_path_are_refused(loaded, data, tmp_path):
    model, processor = loaded
    path = tmp_path / "model"
    model.save_pretrained(path)
    processor.save_pretrained(path)
    m1, p1 = load_model(str(path), device="cpu", dtype="float32")
    out = tmp_path / "out"
    evaluate(m1, p1, "vqav2", data, out_dir=out, limit=2, **KW)
    with torch.no_grad():
        m1.model.language_model.layers[0].mlp.up_proj.weight.add_(0.01)
    m1.save_pretrained(path)  # fine-tuned weights written over the old ones
    m2, p2 = load_model(str(path), device="cpu", dtype="float32")
    with pytest.raises(ResultsError) as err:
        evaluate(m2, p2, "vqav2", data, out_dir=out, limit=2, **KW)
    msg = str(err.value)
    assert "weights.tensors:" in msg and "weights.files.model.safetensors:" in msg
    assert "dtype" not in msg and "limit" not in msg  # only what differs is listed


# ---------------------------------------------------------------- one run per folder


def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(
    loaded, data, tmp_path, monkeypatch
):
    model, processor = loaded
    out = tmp_path / "out"
    started, release = threading.Event(), threading.Event()
    real = runner.generate_batch

    def held(*a, **k):
        if threading.current_thread() is first:  # the first run stays inside generation until released
            started.set()
            assert release.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate_batch", held)
    results = {}
    first = threading.Thread(
        target=lambda: results.setdefault(
            "first", evaluate(model, processor, "vqav2", data, out_dir=out, **KW)
        )
    )
    first.start()
    try:
        assert started.wait(60)
        with pytest.raises(ResultsError, match=rf"in use by another run \(pid {os.getpid()} on .*\)"):
            evaluate(model, processor, "vqav2", data, out_dir=out, **KW)
    finally:
        release.set()
        first.join(60)
    assert results["first"]["counts"]["predictions"] == 4
    lines = (out / "predictions.rank0.jsonl").read_text().splitlines()
    assert len(lines) == 4  # the refused run wrote nothing
    monkeypatch.setattr(runner, "generate_batch", real)
    # the lock file stays behind (here naming a process long gone): it does not block the next run
    (out / ".lock").write_text("pid 999999999 on elsewhere\n")
    assert evaluate(model, processor, "vqav2", data, out_dir=out, **KW)["run"]["new_items"] == 0


def test_an_output_folder_that_cannot_be_written_is_a_clear_error(loaded, data, tmp_path):
    model, processor = loaded
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ResultsError, match="cannot write into the output folder"):
        evaluate(model, processor, "vqav2", data, out_dir=tmp_path / "a_file" / "out", **KW)


# ---------------------------------------------------------------- damaged files


def test_a_damaged_middle_line_is_an_error_naming_it(loaded, data, tmp_path):
    model, processor = loaded
    out = tmp_path / "out"
    evaluate(model, processor, "vqav2", data, out_dir=out, **KW)
    preds = out / "predictions.rank0.jsonl"
    lines = preds.read_text().splitlines(True)
    lines[1] = '{"id": "11", "predi\x00\x00\n'  # damaged after it was written; records 3 and 4 are whole
    preds.write_text("".join(lines))
    before = preds.read_bytes()
    with pytest.raises(DataError, match=r"predictions\.rank0\.jsonl, line 2: not a whole JSON record"):
        evaluate(model, processor, "vqav2", data, out_dir=out, **KW)
    assert preds.read_bytes() == before  # nothing dropped or rewritten
    # a cut-off LAST line is what a crash leaves: dropped, and its item generated again
    preds.write_text("".join([lines[0], lines[2], lines[3][:-9]]))
    res = evaluate(model, processor, "vqav2", data, out_dir=out, **KW)
    assert res["run"]["new_items"] == 2 and res["counts"]["predictions"] == 4


def test_stray_temporary_files_are_removed_and_results_follow_the_umask(loaded, data, tmp_path):
    model, processor = loaded
    out = tmp_path / "out"
    out.mkdir()
    # what a writer killed between creating its temporary file and renaming it leaves
    stray = [out / ".results.json.k2j3_x9a.tmp", out / ".predictions_official.json.0123456789ab.tmp"]
    for f in stray:
        f.write_text('{"half": ')
    (out / "notes.tmp").write_text("the user's own file")
    old = os.umask(0o027)
    try:
        evaluate(model, processor, "vqav2", data, out_dir=out, limit=1, **KW)
    finally:
        os.umask(old)
    assert not any(f.exists() for f in stray)
    assert (out / "notes.tmp").exists()
    assert (out / "results.json").stat().st_mode & 0o777 == 0o640
    assert (out / "run.json").stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------- KV figures


def test_compress_image_counts_the_kv_of_every_request_in_a_batch(loaded, data):
    """With compress='image' a batch is answered in several generate calls (one per question, on its image's
    compressed cache); the batch's KV figures must cover all of them (they once covered only the last), so
    they do not depend on the batch size."""
    model, processor = loaded
    kw = {**KW, "method": "streamingllm", "budget": 0.5, "compress": "image"}
    one = evaluate(model, processor, "vqav2", data, batch_size=1, **kw)["kv"]
    four = evaluate(model, processor, "vqav2", data, batch_size=4, **kw)["kv"]
    assert one["requests"] == four["requests"] == 4  # a generate call per question, in either batching
    for key in ("kv_bytes_full", "kv_bytes_kept", "kv_fraction_kept", "image_kv_fraction_kept"):
        assert four[key] == pytest.approx(one[key]), key
    assert 0 < one["kv_fraction_kept"] < 1


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_during_eval_is_one_line_and_the_rerun_resumes(
    tiny_random_llava_dir, data, tmp_path, monkeypatch, capsys
):
    real = runner.generate_batch
    calls = {"n": 0}

    def interrupted_second_time(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "generate_batch", interrupted_second_time)
    args = _eval_args(tiny_random_llava_dir, data, tmp_path / "out", "--batch-size", "2")
    try:
        rc = main(args)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the command (a traceback for the user)")
    assert rc == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "mm-oval eval: interrupted; the finished predictions are kept in --out: resume with the same command"
    )
    assert not any("Traceback" in line for line in err)
    assert len((tmp_path / "out" / "predictions.rank0.jsonl").read_text().splitlines()) == 2
    assert main(args) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["run"]["new_items"] == 2 and res["counts"]["predictions"] == 4
