"""The lmms-eval plugin `mm_oval_llava`: a local lmms-eval task over the bundled VQAv2 dev files, run by
`python -m lmms_eval`, must give the predictions of mm-oval's own harness on the same items."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmms_eval")

from mm_oval.errors import ConfigError  # noqa: E402
from mm_oval.prompts import chat_prompt  # noqa: E402
from mm_oval.wrapper import wrap_info  # noqa: E402

HERE = Path(__file__).parent
LIMIT = 20

TASK_YAML = """\
task: mm_oval_vqav2_dev
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {questions}
  field: questions
test_split: validation
output_type: generate_until
doc_to_visual: !function mm_oval_vqav2_dev_utils.doc_to_visual
doc_to_text: !function mm_oval_vqav2_dev_utils.doc_to_text
doc_to_target: "question"
generation_kwargs:
  max_new_tokens: 16
  temperature: 0
  until: ["\\n\\n"]
process_results: !function mm_oval_vqav2_dev_utils.process_results
metric_list:
  - metric: vqa_accuracy
    aggregation: mean
    higher_is_better: true
metadata:
  - version: 0.0
"""


POPE_YAML = """\
task: mm_oval_pope_dev
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function mm_oval_pope_dev_utils.doc_to_visual
doc_to_text: !function mm_oval_pope_dev_utils.doc_to_text
doc_to_target: "label"
generation_kwargs:
  max_new_tokens: 16
  temperature: 0
process_results: !function mm_oval_pope_dev_utils.process_results
metric_list:
  - metric: pope_accuracy
    aggregation: !function mm_oval_pope_dev_utils.aggregate_accuracy
    higher_is_better: true
  - metric: pope_precision
    aggregation: !function mm_oval_pope_dev_utils.aggregate_precision
    higher_is_better: true
  - metric: pope_recall
    aggregation: !function mm_oval_pope_dev_utils.aggregate_recall
    higher_is_better: true
  - metric: pope_f1_score
    aggregation: !function mm_oval_pope_dev_utils.aggregate_f1_score
    higher_is_better: true
  - metric: pope_yes_ratio
    aggregation: !function mm_oval_pope_dev_utils.aggregate_yes_ratio
    higher_is_better: true
metadata:
  - version: 0.0
"""

MMBENCH_YAML = """\
task: mm_oval_mmbench_dev
dataset_path: csv
dataset_kwargs:
  data_files:
    dev: {data}
  sep: "\\t"
test_split: dev
output_type: generate_until
doc_to_visual: !function mm_oval_mmbench_dev_utils.doc_to_visual
doc_to_text: !function mm_oval_mmbench_dev_utils.doc_to_text
doc_to_target: "answer"
generation_kwargs:
  max_new_tokens: 16
  temperature: 0
  until: ["ASSISTANT:"]
process_results: !function mm_oval_mmbench_dev_utils.process_results
metric_list:
  - metric: circular_accuracy
    aggregation: !function mm_oval_mmbench_dev_utils.aggregate_circular_accuracy
    higher_is_better: true
metadata:
  - version: 0.0
"""


def _questions_file() -> Path:
    from mm_oval.zoo import bundled_data_dir

    return next(iter(sorted(Path(bundled_data_dir()).glob("vqav2*questions*.json"))))


def _task_dir(tmp_path: Path) -> Path:
    questions = _questions_file()
    d = tmp_path / "tasks"
    d.mkdir()
    from mm_oval.zoo import bundled_data_dir

    data = Path(bundled_data_dir())
    (d / "mm_oval_vqav2_dev.yaml").write_text(TASK_YAML.format(questions=json.dumps(str(questions))))
    (d / "mm_oval_pope_dev.yaml").write_text(POPE_YAML.format(data=json.dumps(str(data / "pope_dev.jsonl"))))
    (d / "mm_oval_mmbench_dev.yaml").write_text(
        MMBENCH_YAML.format(data=json.dumps(str(data / "mmbench_dev.tsv")))
    )
    for utils in (HERE / "lmms_tasks").glob("mm_oval_*_utils.py"):
        (d / utils.name).write_text(utils.read_text())
    return d


def test_entry_point_registers_the_model():
    from lmms_eval.models import get_model

    from mm_oval.integrations.lmms_model import MmOvalLlava

    assert get_model("mm_oval_llava") is MmOvalLlava


def test_bad_model_args_are_project_errors():
    from mm_oval.integrations.lmms_model import MmOvalLlava

    with pytest.raises(ConfigError, match="unknown model_args"):
        MmOvalLlava.create_from_arg_string("pretrained=bundled,methd=snapkv")
    with pytest.raises(ConfigError):
        MmOvalLlava.create_from_arg_string("pretrained=bundled,method=nosuchmethod,budget=0.25")
    with pytest.raises(ConfigError, match="compress"):
        MmOvalLlava.create_from_arg_string("pretrained=bundled,method=snapkv,budget=0.25,compress=later")
    # a spec with several options travels in quotes through lmms-eval's comma-split model_args
    lm = MmOvalLlava.create_from_arg_string(
        'pretrained=bundled,method="snapkv:window=4,text_budget=0.5",budget=0.25,device=cpu'
    )
    cfg = wrap_info(lm.model).config
    assert (cfg.method, cfg.budget, cfg.text_budget, cfg.method_options) == (
        "snapkv",
        0.25,
        0.5,
        {"window": 4},
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_lmms(tmp_path: Path, task: str, nproc: int = 1) -> tuple[Path, Path]:
    """`python -m lmms_eval` (or, for nproc > 1, `accelerate launch --multi_gpu --num_processes N -m lmms_eval`
    with the GPUs hidden: accelerate's `--cpu` path starts a single process unless mpirun is set up, while
    torchrun-style workers on a CPU-only machine talk over gloo) on a local task; (output dir, kv_path)."""
    tasks = _task_dir(tmp_path)
    out = tmp_path / f"out{nproc}"
    kv = out / "kv.json"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"), "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(_free_port())]  # fmt: skip
    cmd = launch + [
        "-m", "lmms_eval", "--model", "mm_oval_llava",
        "--model_args", f"pretrained=bundled,method=snapkv,budget=0.25,dtype=float32,device=cpu,kv_path={kv}",
        "--tasks", task, "--include_path", str(tasks), "--limit", str(LIMIT),
        "--batch_size", "4", "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, kv


def _samples(out: Path, task: str) -> list[dict]:
    return [json.loads(line) for f in out.rglob(f"*_samples_{task}.jsonl") for line in f.open()]


def _results(out: Path, task: str) -> dict:
    return json.loads(next(iter(out.rglob("*_results.json"))).read_text())["results"][task]


def _vqa_predictions(out: Path) -> dict[str, str]:
    samples = _samples(out, "mm_oval_vqav2_dev")
    assert len(samples) == LIMIT
    # lmms-eval's doc_id is the row of the questions file (the dataset)
    questions = json.loads(Path(_questions_file()).read_text())["questions"]
    pred = {}
    for s in samples:
        resp = s["filtered_resps"]
        pred[str(questions[s["doc_id"]]["question_id"])] = resp[0] if isinstance(resp, list) else resp
    return pred


def _harness(tmp_path: Path, task: str) -> tuple[dict[str, str], dict]:
    """mm-oval's own harness on the first LIMIT items: (id -> prediction, results)."""
    from mm_oval.eval.runner import evaluate, load_model

    model, processor = load_model("bundled", device="cpu", dtype="float32")
    res = evaluate(model, processor, task, "bundled", method="snapkv", budget=0.25, limit=LIMIT,
                   batch_size=4, out_dir=tmp_path / f"harness-{task}", progress=False)  # fmt: skip
    pred = {}
    for f in (tmp_path / f"harness-{task}").glob("predictions.rank*.jsonl"):
        for line in f.open():
            r = json.loads(line)
            pred[r["id"]] = r["prediction"]
    return pred, res


@pytest.mark.slow
def test_lmms_eval_run_equals_the_harness(tmp_path):
    out, kv = _run_lmms(tmp_path, "mm_oval_vqav2_dev")
    lmms_pred = _vqa_predictions(out)
    harness, res = _harness(tmp_path, "vqav2")
    assert set(harness) == set(lmms_pred)
    assert lmms_pred == harness
    # same VQA rule (lmms-eval's) on the same items: the same accuracy
    acc = _results(out, "mm_oval_vqav2_dev")["vqa_accuracy,none"]
    assert acc * 100 == pytest.approx(res["scores"]["overall"], abs=0.01)

    figures = json.loads(kv.read_text())
    assert figures["method"] == "snapkv" and figures["budget"] == 0.25
    assert (figures["rank"], figures["world_size"]) == (0, 1)
    assert sum(len(r["docs"]) for r in figures["requests"]) == LIMIT
    s = figures["summary"]
    assert s["kv_bytes_kept"] < s["kv_bytes_full"]
    assert 0 < s["image_kv_fraction_kept"] < 1


@pytest.mark.slow
def test_two_processes_split_the_items_and_answer_as_one(tmp_path):
    """accelerate launch with 2 CPU processes: each rank answers its stride of the docs (lmms-eval's split,
    seen in the per-rank KV files) and the gathered predictions are the single-process harness's."""
    out, kv = _run_lmms(tmp_path, "mm_oval_vqav2_dev", nproc=2)
    assert not kv.exists()
    docs = {}
    for rank in (0, 1):
        figures = json.loads((out / f"kv.rank{rank}.json").read_text())
        assert (figures["rank"], figures["world_size"]) == (rank, 2)
        docs[rank] = sorted(d[2] for r in figures["requests"] for d in r["docs"])
    assert docs[0] == list(range(0, LIMIT, 2)) and docs[1] == list(range(1, LIMIT, 2))
    harness, res = _harness(tmp_path, "vqav2")
    assert _vqa_predictions(out) == harness
    acc = _results(out, "mm_oval_vqav2_dev")["vqa_accuracy,none"]
    assert acc * 100 == pytest.approx(res["scores"]["overall"], abs=0.01)


def test_generate_until_batches_until_and_max_new_tokens():
    """In-process: batch 3 equals batch 1; `until` cuts the answer; max_new_tokens bounds it; the KV figures
    of a wrapped model are recorded per batch with the docs they cover."""
    from types import SimpleNamespace

    from mm_oval.integrations.lmms_model import MmOvalLlava

    sys.path.insert(0, str(HERE / "lmms_tasks"))
    try:
        import mm_oval_vqav2_dev_utils as utils
    finally:
        sys.path.pop(0)
    questions = json.loads(_questions_file().read_text())["questions"][:5]
    docs = {"t": {"validation": questions}}

    def requests(gen):
        return [SimpleNamespace(args=(utils.doc_to_text(q), dict(gen), utils.doc_to_visual, i, "t", "validation"))
                for i, q in enumerate(questions)]  # fmt: skip

    one = MmOvalLlava(pretrained="bundled", method="snapkv", budget=0.25, dtype="float32", device="cpu")
    one.task_dict = docs
    base = one.generate_until(requests({"max_new_tokens": 16, "temperature": 0}))
    assert all(base) and len(base) == 5
    three = MmOvalLlava(pretrained="bundled", method="snapkv", budget=0.25, dtype="float32", device="cpu",
                        batch_size=3)  # fmt: skip
    three.task_dict = docs
    assert three.generate_until(requests({"max_new_tokens": 16, "temperature": 0})) == base
    assert [len(r["docs"]) for r in three.kv_rows] == [3, 2]
    assert three.kv_summary()["image_kv_fraction_kept"] == pytest.approx(0.25)
    stop = base[0][1:]  # everything after the first character
    cut = three.generate_until(requests({"max_new_tokens": 16, "until": [stop]}))
    assert cut[0] == base[0][0]
    short = three.generate_until(requests({"max_new_tokens": 1}))
    assert all(len(three.tokenizer(s, add_special_tokens=False)["input_ids"]) <= 1 for s in short)
    with pytest.raises(ConfigError, match="beam"):
        three.generate_until(requests({"num_beams": 2}))
    assert three.loglikelihood([]) == []


def _lmms_by_doc(out: Path, task: str) -> dict[int, str]:
    samples = _samples(out, task)
    assert len(samples) == LIMIT
    return {s["doc_id"]: (r[0] if isinstance(r := s["filtered_resps"], list) else r) for s in samples}


@pytest.mark.slow
def test_lmms_eval_pope_equals_the_harness(tmp_path):
    """The local POPE task (lmms-eval's prompt and scoring functions over the bundled dev file): the
    harness's predictions on the same 20 rows; the scores agree where lmms-eval's rule is eval_pope's,
    i.e. when every answer is exactly yes or no (lmms-eval compares the lowercased answer with the label,
    LLaVA's eval_pope extracts yes/no first)."""
    from mm_oval.zoo import bundled_data_dir

    out, _ = _run_lmms(tmp_path, "mm_oval_pope_dev")
    rows = [json.loads(line) for line in (Path(bundled_data_dir()) / "pope_dev.jsonl").open()]
    lmms_pred = {str(rows[d]["question_id"]): p for d, p in _lmms_by_doc(out, "mm_oval_pope_dev").items()}
    harness, res = _harness(tmp_path, "pope")
    assert lmms_pred == harness
    assert {p.lower().strip() for p in lmms_pred.values()} <= {"yes", "no"}  # so the rules agree here
    lm = _results(out, "mm_oval_pope_dev")
    scores = res["scores"]
    for ours, theirs in (("accuracy", "pope_accuracy"), ("precision", "pope_precision"),
                         ("recall", "pope_recall"), ("f1", "pope_f1_score")):  # fmt: skip
        assert lm[f"{theirs},none"] * 100 == pytest.approx(scores[ours], abs=1e-6), ours
    # lmms-eval's pope_yes_ratio is the share of yes *labels*; eval_pope's yes_ratio that of yes answers
    labels_yes = sum(rows[i]["label"] == "yes" for i in range(LIMIT)) / LIMIT
    assert lm["pope_yes_ratio,none"] == pytest.approx(labels_yes)


@pytest.mark.slow
def test_lmms_eval_mmbench_equals_the_harness(tmp_path):
    """The local MMBench task (LLaVA-1.5's prompt, lmms-eval's CircularEval with its judge-free `static`
    extraction): lmms-eval's --limit 20 takes the first 20 rows of the TSV (main rows and rotations
    interleaved), and on those rows the predictions are the harness's; the circular accuracy over the same
    rows is the same when mm-oval's OpenCompass extraction finds a letter in every answer (where it does
    not, lmms-eval's static extraction may still find one, mm-oval counts the row wrong)."""
    sys.path.insert(0, str(HERE / "lmms_tasks"))
    try:
        import mm_oval_mmbench_dev_utils as utils
    finally:
        sys.path.pop(0)
    from mm_oval.eval.tasks import get_task

    out, _ = _run_lmms(tmp_path, "mm_oval_mmbench_dev")
    import pandas as pd

    index = pd.read_csv(utils.data_file(), sep="\t", usecols=["index"])["index"].tolist()
    lmms_pred = {str(index[d]): p for d, p in _lmms_by_doc(out, "mm_oval_mmbench_dev").items()}
    harness, _ = _harness(tmp_path, "mmbench")  # the first 20 questions with all their rotations
    assert set(lmms_pred) <= set(harness)
    assert lmms_pred == {k: harness[k] for k in lmms_pred}
    task = get_task("mmbench")
    from mm_oval.zoo import bundled_data_dir

    items = [it for it in task.load(Path(bundled_data_dir()), limit=LIMIT) if it.id in lmms_pred]
    ours = task.score(items, lmms_pred)
    assert ours["num_extraction_misses"] == 0  # the tiny model answers with a bare letter
    lm = _results(out, "mm_oval_mmbench_dev")
    assert lm["circular_accuracy,none"] == pytest.approx(ours["circular_accuracy"], abs=1e-6)


def test_loglikelihood_scores_the_continuation_on_the_compressed_cache():
    """In-process: the sum of the continuation's log-probabilities and whether it is greedy. Without a
    method it equals one forward over context + continuation; under snapkv the first token is scored on
    the full prefill's last logits and the rest on the compressed cache, so a forced 3-token greedy decode
    of the wrapped model (its raw logits) gives the same sum, and longer continuations move away from the
    full cache's."""
    from types import SimpleNamespace

    import torch
    from mm_oval.eval import runner

    from mm_oval.integrations.lmms_model import MmOvalLlava

    sys.path.insert(0, str(HERE / "lmms_tasks"))
    try:
        import mm_oval_vqav2_dev_utils as utils
    finally:
        sys.path.pop(0)
    questions = json.loads(_questions_file().read_text())["questions"][:4]
    docs = {"t": {"validation": questions}}

    def requests(targets):
        return [SimpleNamespace(args=(utils.doc_to_text(q), t, utils.doc_to_visual, i, "t", "validation"))
                for i, (q, t) in enumerate(zip(questions, targets))]  # fmt: skip

    full = MmOvalLlava(pretrained="bundled", method="full", dtype="float32", device="cpu")
    snap = MmOvalLlava(pretrained="bundled", method="snapkv", budget=0.25, dtype="float32", device="cpu")
    full.task_dict = snap.task_dict = docs
    gen = {"max_new_tokens": 16, "temperature": 0}
    answers = full.generate_until(requests([gen] * 4))
    assert all(g for _, g in full.loglikelihood(requests(answers)))
    other = ["purple elephant"] * 4
    full_other = full.loglikelihood(requests(other))
    assert not any(g for _, g in full_other) and all(ll < -1 for ll, _ in full_other)

    model, proc = full.model, full._processor
    q = questions[1]
    text = chat_prompt(proc, utils.doc_to_text(q))
    img = utils.doc_to_visual(q)[0]
    ctx = runner.model_inputs(proc, model, [img], [text])
    both = runner.model_inputs(proc, model, [img], [text + " purple elephant"])
    n = ctx["input_ids"].shape[1]
    with torch.inference_mode():
        logp = model(**both).logits.float().log_softmax(-1)[0]
    cont = both["input_ids"][0, n:]
    assert len(cont) > 1
    ref = float(logp[n - 1 : -1].gather(1, cont[:, None]).sum())
    assert full_other[1][0] == pytest.approx(ref, abs=1e-4)

    # the wrapped model: generate's raw logits step by step on the compressed cache
    model = snap.model
    with torch.inference_mode():
        g = model.generate(**ctx, max_new_tokens=3, min_new_tokens=3, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
    toks = g.sequences[0, n:]
    ref = sum(float(lg[0].float().log_softmax(-1)[t]) for lg, t in zip(g.logits, toks))
    forced = proc.tokenizer.decode(toks)
    snap.kv_rows.clear()
    ll, greedy = snap.loglikelihood(requests([answers[0], forced, answers[2], answers[3]]))[1]
    assert ll == pytest.approx(ref, abs=1e-3)
    assert greedy == bool((torch.stack([lg[0] for lg in g.logits]).argmax(-1) == toks).all())
    assert len(snap.kv_rows) == 4 and snap.kv_summary()["image_kv_fraction_kept"] == pytest.approx(0.25)
    snap_other = snap.loglikelihood(requests(other))
    assert any(abs(a - b) > 1e-3 for (a, _), (b, _) in zip(snap_other, full_other))

    image_first = MmOvalLlava(pretrained="bundled", method="snapkv", budget=0.25, dtype="float32",
                              device="cpu", compress="image")  # fmt: skip
    image_first.task_dict = docs
    with pytest.raises(ConfigError, match="compress=prompt"):
        image_first.loglikelihood(requests(answers))
