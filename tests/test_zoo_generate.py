import base64
import csv
import io
import json
import random

import numpy as np
import pytest
from PIL import Image

from mm_oval.errors import ConfigError
from mm_oval.zoo import bundled_data_dir
from mm_oval.zoo.generate import (
    CIRCULAR_OFFSET,
    COLOR_AT,
    MMB_COLUMNS,
    DevSizes,
    TrainSampler,
    generate_dev_sets,
    image_name,
    make_scene,
)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    generate_dev_sets(out, seed=0)
    return out


def _tsv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_committed_dev_sets_regenerate_identically(regenerated):
    bundled = bundled_data_dir()
    for name in ("vqav2_dev_questions.json", "vqav2_dev_annotations.json", "pope_dev.jsonl", "targets.json"):
        assert (bundled / name).read_text() == (regenerated / name).read_text(), name
    a, b = _tsv(bundled / "mmbench_dev.tsv"), _tsv(regenerated / "mmbench_dev.tsv")
    assert len(a) == len(b)
    for ra, rb in zip(a[:20], b[:20]):
        assert {k: v for k, v in ra.items() if k != "image"} == {k: v for k, v in rb.items() if k != "image"}
        pa = np.asarray(Image.open(io.BytesIO(base64.b64decode(ra["image"]))))
        pb = np.asarray(Image.open(io.BytesIO(base64.b64decode(rb["image"]))))
        assert (pa == pb).all()
    for image_id in (1, 2, 61):
        pa = np.asarray(Image.open(bundled / "images" / image_name(image_id)))
        pb = np.asarray(Image.open(regenerated / "images" / image_name(image_id)))
        assert pa.shape == (128, 128, 3) and (pa == pb).all()


def test_vqa_files_have_the_real_format_and_varied_human_answers():
    d = bundled_data_dir()
    qs = json.loads((d / "vqav2_dev_questions.json").read_text())["questions"]
    anns = json.loads((d / "vqav2_dev_annotations.json").read_text())["annotations"]
    assert len(qs) == len(anns) >= 200
    assert {q["question_id"] for q in qs} == {a["question_id"] for a in anns}
    variants = 0
    for a in anns:
        assert set(a) >= {
            "question_id",
            "image_id",
            "question_type",
            "answer_type",
            "answers",
            "multiple_choice_answer",
        }
        assert len(a["answers"]) == 10
        texts = [x["answer"] for x in a["answers"]]
        assert (
            texts.count(a["multiple_choice_answer"]) >= 4
        )  # a right answer scores 1.0 under the 3-of-10 rule
        variants += len(set(texts)) > 1
        assert (d / "images" / image_name(a["image_id"])).is_file()
    assert variants > len(anns) // 2
    assert {a["question_type"] for a in anns} == {
        "color of shape", "shape of color", "count of color", "color at position", "exists",
    }  # fmt: skip


def test_mmbench_rotations_share_index_mod_1e6_and_move_the_answer():
    rows = _tsv(bundled_data_dir() / "mmbench_dev.tsv")
    assert list(rows[0].keys()) == MMB_COLUMNS
    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(int(r["index"]) % CIRCULAR_OFFSET, []).append(r)
    assert len(groups) >= 100
    for rs in groups.values():
        n_opts = sum(bool(rs[0][c]) for c in "ABCD")
        assert 2 <= n_opts <= 4 and len(rs) == n_opts
        answers = {r[r["answer"]] for r in rs}
        assert len(answers) == 1  # every rotation's letter points at the same option text
        assert len({r["answer"] for r in rs}) == n_opts
    hints = [rs[0]["hint"] for rs in groups.values()]
    assert sum(bool(h) for h in hints) >= len(hints) // 5


def test_pope_is_balanced_with_three_negative_kinds():
    lines = [json.loads(x) for x in (bundled_data_dir() / "pope_dev.jsonl").read_text().splitlines()]
    assert len(lines) >= 200
    assert sum(x["label"] == "yes" for x in lines) == len(lines) // 2
    assert {x["category"] for x in lines if x["label"] == "no"} == {"random", "popular", "adversarial"}
    per_image: dict[str, set] = {}
    for x in lines:
        assert set(x) >= {"question_id", "image", "text", "label"}
        per_image.setdefault(x["image"], set()).add(x["text"])
    assert all(len(v) == 6 for v in per_image.values())  # no question repeated on an image


def test_targets_point_at_the_objects_the_answers_name():
    d = bundled_data_dir()
    targets = json.loads((d / "targets.json").read_text())
    for qid, t in list(targets["vqav2"].items())[:60]:
        if t["type"] == COLOR_AT:
            image_id = int(qid) // 1000
            img = np.asarray(Image.open(d / "images" / image_name(image_id)))
            ((r, c),) = t["targets"]
            cell = img[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16]
            assert cell.reshape(-1, 3).max(0).sum() > 100  # the target cell is not empty


def test_train_sampler_is_deterministic_and_disjoint_from_dev():
    s = TrainSampler(seed=3)
    a, b = s.item(7, 12), s.item(7, 12)
    assert [q.text for q in a.questions] == [q.text for q in b.questions]
    assert (np.asarray(a.image) == np.asarray(b.image)).all()
    assert len(a.questions) == 12
    assert [q.text for q in TrainSampler(seed=4).item(7, 12).questions] != [q.text for q in a.questions]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sizes": DevSizes(vqa_images=0)},
        {"sizes": DevSizes(min_objects=5, max_objects=4)},
        {"sizes": DevSizes(max_objects=65)},
        {"seed": -1},
    ],
)
def test_bad_generator_inputs_raise_clear_errors(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        generate_dev_sets(tmp_path, **kwargs)


def test_make_scene_rejects_impossible_counts():
    with pytest.raises(ConfigError, match="min_objects"):
        make_scene(random.Random(0), 0, 3)
    with pytest.raises(ConfigError):
        TrainSampler(0, mmbench_fraction=1.5)
