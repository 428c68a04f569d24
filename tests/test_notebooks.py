"""The example notebooks run top to bottom on a kernel of this Python and show what they promise: the answers
side by side, the KV memory kept, the kept patches and the pages read. As written they use the bundled tiny LLaVA
(skipped only while its checkpoint is missing); any LLaVA path works through their parameters cell, which a
tiny random model exercises here."""

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
    from mm_oval.zoo import bundled_model_path

    try:
        bundled_model_path()
    except ModelError as e:
        pytest.skip(f"the bundled tiny LLaVA checkpoint is missing: {e}")


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


def check_kept_notebook(nb, eviction: list[str], n_layers: int) -> None:
    texts, markdown, pngs = _outputs(nb)
    assert pngs == len(eviction) + 2  # one grid per eviction method, the head votes, the retrieval grid
    iou = _table_rows(markdown[0])
    assert len(iou) == 1 + n_layers  # header + one row per layer
    assert all(0.0 <= float(v) <= 1.0 for row in iou[1:] for v in row[1:])
    line = next(t for t in texts if t.startswith("pages read per decode step"))
    share = int(re.search(r"(\d+)%", line)[1])
    assert 25 <= share < 50  # ceil(25%) of the candidate pages per KV head and step


def test_chat_with_image_notebook_on_the_bundled_model():
    _bundled_or_skip()
    nb = _executor().execute(EXAMPLES / "chat_with_image.ipynb")
    methods = {"full cache": ("full", None), "KVP 25%": ("kvp", 0.25), "SnapKV 25%": ("snapkv", 0.25)}
    check_chat_notebook(nb, methods, n_questions=5)


def test_what_the_cache_kept_notebook_on_the_bundled_model():
    _bundled_or_skip()
    from mm_oval.zoo import bundled_model_path

    nb = _executor().execute(EXAMPLES / "what_the_cache_kept.ipynb")
    check_kept_notebook(nb, ["snapkv", "kvp"], _n_layers(bundled_model_path()))


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
    nb = run(
        EXAMPLES / "what_the_cache_kept.ipynb",
        {**common, "QUESTION": repr(question), "EVICTION": repr(["snapkv", "tova"])},
    )
    check_kept_notebook(nb, ["snapkv", "tova"], _n_layers(tiny_random_llava_dir))
