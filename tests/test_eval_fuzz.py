"""Corrupt, truncated and mis-encoded data and prediction files: every task's loaders (and the scorer
on what they return) either work or raise a project error, never another exception type."""

import json
import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from mm_oval.eval.tasks import get_task

from mm_oval.errors import MmOvalError

# CI runs a fixed set of examples (a red run must be reproducible); MM_OVAL_FUZZ_EXAMPLES=2000 explores
# new random ones on a developer's machine.
_DEEP = int(os.environ.get("MM_OVAL_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(max_examples=_DEEP or 60, derandomize=not _DEEP, deadline=None, database=None)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)

ANSWERS = [{"answer": "yes", "answer_confidence": "yes", "answer_id": i + 1} for i in range(10)]
VALID = {
    "vqav2": (
        {"questions": [{"question_id": 1, "image_id": 1, "question": "Is it?"},
                       {"question_id": 2, "image_id": 1, "question": "Café?"}]},
        {"annotations": [{"question_id": 1, "image_id": 1, "question_type": "is", "answer_type": "yes/no",
                          "answers": ANSWERS}]},
        [{"question_id": 1, "answer": "yes"}, {"question_id": 2, "answer": "no"}],
    ),
    "textvqa": (
        {"data": [{"question_id": 1, "question": "what?", "image_id": "a", "answers": ["nikon"] * 10}]},
        None,
        [{"question_id": 1, "answer": "Nikon"}],
    ),
    "pope": (
        [{"question_id": 1, "image": "a.jpg", "text": "Is there a dog?", "label": "yes"},
         {"question_id": 2, "image": "a.jpg", "text": "Is there a cat?", "label": "no"}],
        None,
        [{"question_id": 1, "text": "Yes"}, {"question_id": 2, "text": "No, there is not."}],
    ),
}  # fmt: skip
MMB_DATA = (
    "index\tquestion\thint\tA\tB\tC\tanswer\tcategory\tl2-category\timage\n"
    "0\tWhich?\tnan\tcat\tdog\tnone\tB\tc1\tl2\tiVBORw0KGgo=\n"
    "1000000\tWhich?\t\tdog\tnone\tcat\tA\tc1\tl2\t0\n"
)
MMB_PREDS = "index\tprediction\n0\tB\n1000000\tN/A\n"


def _encode(obj, jsonl: bool) -> str:
    if jsonl:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in obj)
    return json.dumps(obj, ensure_ascii=False)


def _replace_value(obj, path: list[int], value):
    """`obj` with one nested value (picked by `path`) replaced by `value`."""
    if not path or not isinstance(obj, (dict, list)) or not obj:
        return value
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    key = keys[path[0] % len(keys)]
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[key] = _replace_value(obj[key], path[1:], value)
    return out


@st.composite
def damaged(draw, text: str) -> bytes:
    """The bytes of `text`, truncated, with bytes overwritten, or in another encoding."""
    kind = draw(st.sampled_from(["truncate", "overwrite", "encoding", "insert"]))
    raw = text.encode("utf-8")
    if kind == "truncate":
        return raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    if kind == "encoding":
        enc = draw(st.sampled_from(["latin-1", "utf-16", "cp1252", "utf-32"]))
        return text.encode(enc, errors="replace")
    pos = draw(st.integers(0, len(raw)))
    junk = draw(st.binary(min_size=1, max_size=4))
    if kind == "insert":
        return raw[:pos] + junk + raw[pos:]
    return raw[:pos] + junk + raw[pos + len(junk) :]


def _run(task_name: str, files: dict[str, bytes], data: str, predictions: str) -> None:
    """Load the data, read the predictions, score: only project errors may come out."""
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for name, blob in files.items():
            (root / name).write_bytes(blob)
        task = get_task(task_name)
        try:
            items = task.load(root / data if data else root)
            preds = task.read_predictions(root / predictions, items)
            task.score(items, preds)
        except MmOvalError:
            pass


NAMES = {
    "vqav2": ("v2_questions.json", "v2_annotations.json", "", "preds.json"),
    "textvqa": ("TextVQA_val.json", None, "TextVQA_val.json", "preds.json"),
    "pope": ("pope.jsonl", None, "pope.jsonl", "answers.jsonl"),
}


def _files(task: str, which: int, blob: bytes) -> dict[str, bytes]:
    """The task's valid files, the one at position `which` (data, annotations, predictions) replaced."""
    data, anns, preds = VALID[task]
    qname, aname, _, pname = NAMES[task]
    jsonl = task == "pope"
    out = {qname: _encode(data, jsonl).encode(), pname: _encode(preds, jsonl).encode()}
    if anns is not None:
        out[aname] = _encode(anns, False).encode()
    names = [qname, aname, pname] if anns is not None else [qname, pname]
    out[names[which % len(names)]] = blob
    return out


@SETTINGS
@given(task=st.sampled_from(sorted(NAMES)), which=st.integers(0, 2), data=st.data())
def test_json_tasks_survive_damaged_bytes(task, which, data):
    qname, aname, dname, pname = NAMES[task]
    valid = VALID[task]
    texts = [_encode(valid[0], task == "pope")]
    if valid[1] is not None:
        texts.append(_encode(valid[1], False))
    texts.append(_encode(valid[2], task == "pope"))
    blob = data.draw(damaged(texts[which % len(texts)]))
    _run(task, _files(task, which, blob), dname, pname)


@SETTINGS
@given(
    task=st.sampled_from(sorted(NAMES)),
    which=st.integers(0, 2),
    path=st.lists(st.integers(0, 9), max_size=4),
    value=json_values,
)
def test_json_tasks_survive_wrong_values(task, which, path, value):
    _, _, dname, pname = NAMES[task]
    valid = VALID[task]
    objs = [valid[0]] + ([valid[1]] if valid[1] is not None else []) + [valid[2]]
    i = which % len(objs)
    jsonl = task == "pope" and i != 1
    obj = _replace_value(objs[i], path, value)
    if jsonl and not isinstance(obj, list):
        obj = [obj]
    try:
        blob = _encode(obj, jsonl).encode("utf-8", errors="surrogatepass")
    except (TypeError, ValueError):
        return
    _run(task, _files(task, which, blob), dname, pname)


@SETTINGS
@given(which=st.sampled_from(["data", "predictions", "xlsx"]), data=st.data())
def test_mmbench_survives_damaged_tables(which, data):
    files = {"mmbench_dev.tsv": MMB_DATA.encode(), "preds.tsv": MMB_PREDS.encode()}
    pname = "preds.tsv"
    if which == "data":
        files["mmbench_dev.tsv"] = data.draw(damaged(MMB_DATA))
    elif which == "predictions":
        files["preds.tsv"] = data.draw(damaged(MMB_PREDS))
    else:  # a damaged workbook: any bytes under an .xlsx name
        pname = "preds.xlsx"
        files[pname] = data.draw(st.binary(max_size=64))
    _run("mmbench", files, "mmbench_dev.tsv", pname)
