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


def _questions_file() -> Path:
    from mm_oval.zoo import bundled_data_dir

    return next(iter(sorted(Path(bundled_data_dir()).glob("vqav2*questions*.json"))))


def _task_dir(tmp_path: Path) -> Path:
    questions = _questions_file()
    d = tmp_path / "tasks"
    d.mkdir()
    (d / "mm_oval_vqav2_dev.yaml").write_text(TASK_YAML.format(questions=json.dumps(str(questions))))
    (d / "mm_oval_vqav2_dev_utils.py").write_text(
        (HERE / "lmms_tasks" / "mm_oval_vqav2_dev_utils.py").read_text()
    )
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
    cfg = lm.model._mm_oval.config
    assert (cfg.method, cfg.budget, cfg.text_budget, cfg.method_options) == ("snapkv", 0.25, 0.5, {"window": 4})


@pytest.mark.slow
def test_lmms_eval_run_equals_the_harness(tmp_path):
    from mm_oval.eval.runner import evaluate, load_model

    tasks = _task_dir(tmp_path)
    out = tmp_path / "out"
    kv = out / "kv.json"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}  # fmt: skip
    cmd = [
        sys.executable, "-m", "lmms_eval", "--model", "mm_oval_llava",
        "--model_args", f"pretrained=bundled,method=snapkv,budget=0.25,dtype=float32,device=cpu,kv_path={kv}",
        "--tasks", "mm_oval_vqav2_dev", "--include_path", str(tasks), "--limit", str(LIMIT),
        "--batch_size", "4", "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    samples = [json.loads(line) for f in out.rglob("*_samples_mm_oval_vqav2_dev.jsonl") for line in f.open()]
    assert len(samples) == LIMIT
    # lmms-eval's doc_id is the row of the questions file (the dataset)
    questions = json.loads(Path(_questions_file()).read_text())["questions"]
    lmms_pred = {}
    for s in samples:
        resp = s["filtered_resps"]
        lmms_pred[str(questions[s["doc_id"]]["question_id"])] = resp[0] if isinstance(resp, list) else resp

    model, processor = load_model("bundled", device="cpu", dtype="float32")
    res = evaluate(model, processor, "vqav2", "bundled", method="snapkv", budget=0.25, limit=LIMIT,
                   batch_size=4, out_dir=tmp_path / "harness", progress=False)  # fmt: skip
    harness = {}
    for f in (tmp_path / "harness").glob("predictions.rank*.jsonl"):
        for line in f.open():
            r = json.loads(line)
            harness[r["id"]] = r["prediction"]
    assert set(harness) == set(lmms_pred)
    assert lmms_pred == harness
    # same VQA rule (lmms-eval's) on the same items: the same accuracy
    results = json.loads(next(iter(out.rglob("*_results.json"))).read_text())
    acc = results["results"]["mm_oval_vqav2_dev"]["vqa_accuracy,none"]
    assert acc * 100 == pytest.approx(res["scores"]["overall"], abs=0.01)

    figures = json.loads(kv.read_text())
    assert figures["method"] == "snapkv" and figures["budget"] == 0.25
    assert sum(len(r["docs"]) for r in figures["requests"]) == LIMIT
    s = figures["summary"]
    assert s["kv_bytes_kept"] < s["kv_bytes_full"]
    assert 0 < s["image_kv_fraction_kept"] < 1


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
    with pytest.raises(ConfigError, match="loglikelihood"):
        three.loglikelihood([])
