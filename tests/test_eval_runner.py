"""The runner's mechanics on a tiny random LLaVA and tiny datasets in the real formats: batching with left
padding, resume after a crash, sharding over 2 accelerate processes, the results files, errors."""

import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mm_oval.eval import runner
from mm_oval.eval.files import JsonlAppender
from mm_oval.eval.runner import evaluate, load_model, score_file
from PIL import Image

import mm_oval
from mm_oval.errors import ConfigError, DataError, ModelError, ResultsError

COLORS = ["red", "green", "blue", "yellow"]


def _png(color: str, size: int = 128) -> Image.Image:
    im = Image.new("RGB", (size, size), "gray")
    im.paste(Image.new("RGB", (size // 2, size // 2), color), (size // 4, size // 4))
    return im


def make_vqav2(root: Path, n_images: int = 4, per_image: int = 2) -> Path:
    (root / "images").mkdir(parents=True)
    questions, annotations = [], []
    qid = 0
    for i in range(n_images):
        image_id = 100 + i
        _png(COLORS[i % 4]).save(root / "images" / f"COCO_val2014_{image_id:012d}.png")
        for q in ["what color is the square ?", "how many objects are there ?"][:per_image]:
            qid += 1
            questions.append({"question_id": qid, "image_id": image_id, "question": q})
            ans = COLORS[i % 4] if "color" in q else "one"
            annotations.append(
                {
                    "question_id": qid,
                    "image_id": image_id,
                    "question_type": "what color" if "color" in q else "how many",
                    "answer_type": "other" if "color" in q else "number",
                    "multiple_choice_answer": ans,
                    "answers": [
                        {"answer": ans, "answer_confidence": "yes", "answer_id": k + 1} for k in range(10)
                    ],
                }
            )
    (root / "vqav2_dev_questions.json").write_text(json.dumps({"questions": questions}))
    (root / "vqav2_dev_annotations.json").write_text(json.dumps({"annotations": annotations}))
    return root


def make_mmbench(path: Path, n: int = 2) -> Path:
    buf = io.BytesIO()
    _png("red").save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    lines = ["index\tquestion\thint\tA\tB\tC\tD\tanswer\tcategory\timage\tl2-category\tsplit"]
    for q in range(n):
        opts = COLORS[:]
        for k in range(4):
            rot = opts[k:] + opts[:k]
            answer = "ABCD"[rot.index("red")]
            lines.append(
                "\t".join(
                    [
                        str(q + k * 1_000_000),
                        "what color is the square ?",
                        "" if q else "look at the image",
                        *rot,
                        answer,
                        f"cat{q}",
                        b64,
                        "perception",
                        "dev",
                    ]
                )  # fmt: skip
            )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def loaded(tiny_random_llava_dir):
    return load_model(str(tiny_random_llava_dir), device="cpu")


@pytest.fixture(scope="module")
def vqa_dir(tmp_path_factory):
    return make_vqav2(tmp_path_factory.mktemp("vqa"))


def _preds(out: Path) -> dict:
    recs = {}
    for f in sorted(out.glob("predictions.rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            recs[r["id"]] = r["prediction"]
    return recs


def _comparable(results: dict) -> dict:
    # what must not depend on how the run was executed (timings, world size, batch size may differ)
    return {k: results[k] for k in ("task", "primary", "counts", "scores", "kv")}


@pytest.fixture(scope="module")
def reference(loaded, vqa_dir, tmp_path_factory):
    """One uninterrupted single-process run, batch size 1: what every other way of running must equal."""
    model, processor = loaded
    out = tmp_path_factory.mktemp("reference")
    return evaluate(
        model, processor, "vqav2", vqa_dir, batch_size=1, out_dir=out, max_new_tokens=6, progress=False
    ), out


def test_batch_of_4_equals_batch_of_1(loaded, vqa_dir, tmp_path, reference):
    model, processor = loaded
    r1, b1 = reference
    r4 = evaluate(
        model,
        processor,
        "vqav2",
        vqa_dir,
        batch_size=4,
        out_dir=tmp_path / "b4",
        max_new_tokens=6,
        progress=False,
    )
    p1, p4 = _preds(b1), _preds(tmp_path / "b4")
    assert len(p1) == 8 and p1 == p4
    assert len(set(p1.values())) > 1  # the random model's answers differ between questions: a real check
    assert _comparable(r1) == _comparable(r4)
    # the results file is what evaluate returned, and the official predictions file scores the same
    on_disk = json.loads((b1 / "results.json").read_text())
    assert on_disk["scores"] == r1["scores"] and on_disk["config"]["task"] == "vqav2"
    rescored = score_file("vqav2", vqa_dir, b1 / "predictions_official.json")
    assert rescored["scores"] == r1["scores"]


def _whole_run(results: dict) -> dict:
    # the whole results file except wall-clock timings and what this particular execution generated
    out = {k: v for k, v in results.items() if k != "timings"}
    out["run"] = {k: v for k, v in results["run"].items() if k not in ("new_items", "per_rank")}
    return json.loads(json.dumps(out))


@pytest.mark.parametrize(
    "method, budget, compress, batch_size, kill_mid_batch",
    [("full", None, "prompt", 2, False), ("streamingllm", 0.5, "prompt", 2, False),
     ("streamingllm", 0.5, "image", 4, True)],
)  # fmt: skip
def test_killed_run_resumes_to_the_same_results(
    loaded, vqa_dir, tmp_path, monkeypatch, method, budget, compress, batch_size, kill_mid_batch
):
    model, processor = loaded
    kw = {"batch_size": batch_size, "max_new_tokens": 6, "progress": False, "method": method,
          "budget": budget, "compress": compress}  # fmt: skip
    full = evaluate(model, processor, "vqav2", vqa_dir, out_dir=tmp_path / "ref", **kw)
    if method != "full":
        assert full["kv"]["kv_fraction_kept"] < 1.0  # the KV figures are part of what must match

    out = tmp_path / "run"
    if kill_mid_batch:
        # the process is stopped while it writes the records of its second batch (items 5 to 8)
        real_write = JsonlAppender.write
        writes = {"n": 0}

        def dies_at_the_sixth_record(self, rec):
            if writes["n"] == 5:
                raise KeyboardInterrupt
            writes["n"] += 1
            real_write(self, rec)

        monkeypatch.setattr(JsonlAppender, "write", dies_at_the_sixth_record)
        with pytest.raises(KeyboardInterrupt):
            evaluate(model, processor, "vqav2", vqa_dir, out_dir=out, **kw)
        monkeypatch.setattr(JsonlAppender, "write", real_write)
        done, redone = 5, 3
    else:
        real = runner.generate_batch
        calls = {"n": 0}

        def dies_after_two_batches(*a, **k):
            if calls["n"] == 2:
                raise KeyboardInterrupt  # the process is stopped mid-run
            calls["n"] += 1
            return real(*a, **k)

        monkeypatch.setattr(runner, "generate_batch", dies_after_two_batches)
        with pytest.raises(KeyboardInterrupt):
            evaluate(model, processor, "vqav2", vqa_dir, out_dir=out, **kw)
        monkeypatch.setattr(runner, "generate_batch", real)
        done, redone = 4, 4
    assert not (out / "results.json").exists()
    assert len(_preds(out)) == done
    assert not mm_oval.is_wrapped(model)  # unwrapped even after the interruption
    # a crash in the middle of writing a record leaves half a line
    with open(out / "predictions.rank0.jsonl", "a") as f:
        f.write('{"id": "7", "predic')
    resumed = evaluate(model, processor, "vqav2", vqa_dir, out_dir=out, **kw)
    assert resumed["run"]["new_items"] == redone  # only the unfinished items were written
    assert _whole_run(resumed) == _whole_run(full)
    assert _preds(out) == _preds(tmp_path / "ref")
    on_disk = json.loads((out / "results.json").read_text())
    assert _whole_run(on_disk) == _whole_run(full)
    again = evaluate(model, processor, "vqav2", vqa_dir, out_dir=out, **kw)
    assert again["run"]["new_items"] == 0 and _whole_run(again) == _whole_run(full)


def test_output_dir_of_another_config_is_refused(loaded, vqa_dir, tmp_path):
    model, processor = loaded
    evaluate(model, processor, "vqav2", vqa_dir, limit=2, out_dir=tmp_path, max_new_tokens=6, progress=False)
    with pytest.raises(ResultsError, match="limit: 2 there, 3 now"):
        evaluate(
            model, processor, "vqav2", vqa_dir, limit=3, out_dir=tmp_path, max_new_tokens=6, progress=False
        )


def test_mmbench_end_to_end_and_score_roundtrip(loaded, tmp_path):
    model, processor = loaded
    tsv = make_mmbench(tmp_path / "mmbench_dev.tsv")
    res = evaluate(
        model,
        processor,
        "mmbench",
        tsv,
        batch_size=4,
        out_dir=tmp_path / "out",
        max_new_tokens=6,
        progress=False,
    )
    assert res["scores"]["num_questions"] == 2 and res["scores"]["num_rows"] == 8
    again = score_file("mmbench", tsv, tmp_path / "out" / "predictions_official.tsv")
    assert again["scores"] == res["scores"]
    # a prediction file from another toolkit: all rotations right -> 100
    rows = ["index\tprediction"] + [
        f"{q + k * 1_000_000}\t{'ABCD'[(['red', 'green', 'blue', 'yellow'][k:] + ['red', 'green', 'blue', 'yellow'][:k]).index('red')]}"
        for q in range(2)
        for k in range(4)
    ]
    (tmp_path / "theirs.tsv").write_text("\n".join(rows) + "\n")
    assert score_file("mmbench", tsv, tmp_path / "theirs.tsv")["scores"]["circular_accuracy"] == 100.0


def test_multi_turn_full_cache_matches_reprefill(loaded, vqa_dir, tmp_path):
    model, processor = loaded
    res = evaluate(
        model, processor, "vqav2", vqa_dir, multi_turn=2, out_dir=tmp_path, max_new_tokens=6, progress=False
    )
    recs = [json.loads(x) for x in (tmp_path / "predictions.rank0.jsonl").read_text().splitlines()]
    assert sorted(r["turn"] for r in recs) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert res["counts"]["predictions"] == 8
    assert {t: v["items"] for t, v in res["scores_by_turn"].items()} == {"0": 4, "1": 4}
    # later turns reuse the cache: each answer must equal a fresh generate over the whole conversation
    from mm_oval.eval.runner import generate_conversation
    from mm_oval.eval.vqa import VQAv2Task

    items = VQAv2Task().load(vqa_dir)
    by_id = {r["id"]: r["prediction"] for r in recs}
    for conv in (items[0:2], items[2:4]):
        fresh = generate_conversation(model, processor, conv, 6, reuse_cache=False)
        assert [by_id[it.id] for it in conv] == [t for t, _ in fresh]


def test_clear_errors(loaded, tmp_path, vqa_dir):
    model, processor = loaded
    with pytest.raises(DataError, match="not found"):
        evaluate(model, processor, "vqav2", tmp_path / "nope", max_new_tokens=6, progress=False)
    bad = tmp_path / "bad.tsv"
    make_mmbench(bad)
    lines = bad.read_text().splitlines()
    lines[3] = lines[3].replace("\t", " ", 2)  # row 4: two cells merged
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="row 4"):
        evaluate(model, processor, "mmbench", bad, max_new_tokens=6, progress=False)
    broken = make_vqav2(tmp_path / "v")
    (broken / "images" / "COCO_val2014_000000000101.png").unlink()
    with pytest.raises(DataError, match="COCO_val2014_000000000101"):
        evaluate(model, processor, "vqav2", broken, max_new_tokens=6, progress=False)
    with pytest.raises(ConfigError, match="unknown task"):
        evaluate(model, processor, "gqa", vqa_dir, max_new_tokens=6, progress=False)
    cfg_dir = tmp_path / "not_llava"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="LLaVA-style"):
        load_model(str(cfg_dir), device="cpu")


@pytest.mark.slow
def test_two_accelerate_processes_equal_one(tiny_random_llava_dir, vqa_dir, tmp_path, reference):
    one, one_dir = reference
    accelerate = Path(sys.executable).with_name("accelerate")
    # accelerate's --cpu launcher starts one process unless MPI is set up; --multi_gpu starts the processes
    # torchrun-style, and without a GPU they talk over gloo on the CPU
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "mm_oval.eval",
           "--model", str(tiny_random_llava_dir), "--task", "vqav2", "--data", str(vqa_dir),
           "--batch-size", "2", "--max-new-tokens", "6", "--out", str(tmp_path / "two"), "--no-progress", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - t
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"2-process accelerate launch took {elapsed:.1f} s")
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["run"]["world_size"] == 2
    assert sorted(two["run"]["per_rank"]) == ["0", "1"]
    assert {v["items"] for v in two["run"]["per_rank"].values()} == {4}
    assert (tmp_path / "two" / "predictions.rank1.jsonl").exists()
    assert _preds(tmp_path / "two") == _preds(one_dir)
    assert _comparable(two) == json.loads(json.dumps(_comparable(one)))


KILLABLE = """
import sys, time
from mm_oval.eval import runner
real = runner.generate_batch
def slow(*a, **k):
    time.sleep(0.4)  # leaves time to kill the process between two batches or in the middle of one
    return real(*a, **k)
runner.generate_batch = slow
from mm_oval.eval.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkilled_process_resumes_to_the_same_results(
    loaded, tiny_random_llava_dir, vqa_dir, tmp_path, reference
):
    import signal

    model, processor = loaded
    kw = {"batch_size": 1, "max_new_tokens": 6, "progress": False}
    ref, ref_dir = reference
    out = tmp_path / "killed"
    script = tmp_path / "killable.py"
    script.write_text(KILLABLE)
    args = ["--model", str(tiny_random_llava_dir), "--task", "vqav2", "--data", str(vqa_dir), "--out", str(out),
            "--batch-size", "1", "--max-new-tokens", "6", "--dtype", "float32", "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    preds = out / "predictions.rank0.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if preds.exists() and len(preds.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    assert not (out / "results.json").exists()
    whole = [
        line for line in preds.read_text().split("\n")[:-1] if line.strip()
    ]  # a cut last line is not whole
    assert 2 <= len(whole) < 8
    resumed = evaluate(
        model, processor, "vqav2", vqa_dir, out_dir=out, model_name=str(tiny_random_llava_dir), **kw
    )
    assert resumed["run"]["new_items"] == 8 - len(whole)
    assert _preds(out) == _preds(ref_dir)
    assert _comparable(resumed) == _comparable(ref)


def test_compress_after_image_keeps_full_cache_answers_and_lets_methods_see_less(
    loaded, vqa_dir, tmp_path, reference
):
    """compress='image' splits each prompt after the image: with the full cache nothing changes; with a
    method, the question is read through the compressed cache, so keeping 1 image token changes answers."""
    model, processor = loaded
    _, b1 = reference
    kw = {"max_new_tokens": 6, "progress": False}
    evaluate(model, processor, "vqav2", vqa_dir, batch_size=3, compress="image", out_dir=tmp_path / "f", **kw)
    assert _preds(tmp_path / "f") == _preds(b1)
    prompt_side = evaluate(model, processor, "vqav2", vqa_dir, method="streamingllm", budget=1, **kw)
    image_side = evaluate(
        model, processor, "vqav2", vqa_dir, method="streamingllm", budget=1, compress="image",
        batch_size=3, out_dir=tmp_path / "s", **kw,
    )  # fmt: skip
    assert image_side["config"]["compress"] == "image"
    # 1 token + the 16 recent ones (all image tokens when the prompt ends at the image) of 64
    assert image_side["kv"]["image_kv_fraction_kept"] == pytest.approx(17 / 64)
    assert _preds(tmp_path / "s") != _preds(b1)
    assert prompt_side["counts"]["predictions"] == image_side["counts"]["predictions"] == 8
    with pytest.raises(ConfigError, match="compress"):
        evaluate(model, processor, "vqav2", vqa_dir, compress="question", **kw)


def test_compress_image_prefills_each_image_once_and_answers_as_one_question_at_a_time(
    loaded, vqa_dir, tmp_path, monkeypatch
):
    """Question-agnostic: the head (template + image) does not depend on the question, so the questions about
    one image share its prefill and compression; each is answered on its own copy of that cache, as if it
    were asked alone (a method that changed the shared cache while answering would break this)."""
    from mm_oval.eval import runner

    model, processor = loaded
    heads = []
    real = runner.prefill

    def counting(m, **inputs):
        heads.append(inputs["input_ids"].shape)
        return real(m, **inputs)

    monkeypatch.setattr(runner, "prefill", counting)
    kw = {"max_new_tokens": 6, "progress": False, "method": "snapkv", "budget": 0.25, "compress": "image"}
    together = evaluate(model, processor, "vqav2", vqa_dir, batch_size=8, out_dir=tmp_path / "b8", **kw)
    assert len(heads) == 4 and all(h[0] == 1 for h in heads)  # 8 questions, 4 images: one prefill each
    heads.clear()
    alone = evaluate(model, processor, "vqav2", vqa_dir, batch_size=1, out_dir=tmp_path / "b1", **kw)
    assert len(heads) == 8
    assert _preds(tmp_path / "b8") == _preds(tmp_path / "b1")
    assert together["kv"] == alone["kv"]


def test_options_as_an_object_give_the_same_run_as_keywords(loaded, vqa_dir, tmp_path, reference):
    from mm_oval.eval.runner import EvalOptions

    model, processor = loaded
    r1, b1 = reference
    opts = EvalOptions(batch_size=1, out_dir=tmp_path / "opts", max_new_tokens=6, progress=False)
    r2 = evaluate(model, processor, "vqav2", vqa_dir, opts)
    assert _comparable(r2) == _comparable(r1) and _preds(tmp_path / "opts") == _preds(b1)
    assert json.loads((tmp_path / "opts" / "run.json").read_text()) == json.loads(
        (b1 / "run.json").read_text()
    )
    r3 = evaluate(model, processor, "vqav2", vqa_dir, options=EvalOptions(max_new_tokens=6, progress=False))
    assert _comparable(r3) == _comparable(r1)
    # the fields in their order, as evaluate's parameters were
    r4 = evaluate(model, processor, "vqav2", vqa_dir, "full", None, None, 1, 6, progress=False)
    assert _comparable(r4) == _comparable(r1)
    with pytest.raises(TypeError, match="not both"):
        evaluate(model, processor, "vqav2", vqa_dir, opts, limit=2)
    with pytest.raises(TypeError):
        evaluate(model, processor, "vqav2", vqa_dir, no_such_option=1)
