"""The 576-token benchmark: every answer and target is recomputed here from the scene objects with code of
its own (regions, orders, distances), and the committed folder is compared with a full regeneration."""

import base64
import csv
import hashlib
import io
import json
import math
import random
import re

import numpy as np
import pytest
from mm_oval.eval.tasks import resolve_data
from PIL import Image

from mm_oval.cli import main
from mm_oval.errors import ConfigError
from mm_oval.prompts import LIST_INSTRUCTION, mmbench_prompt, short_answer_prompt
from mm_oval.training.router import load_prompts
from mm_oval.training.traces import load_samples
from mm_oval.zoo import bundled576_data_dir
from mm_oval.zoo.generate import CIRCULAR_OFFSET, MMB_COLUMNS
from mm_oval.zoo.generate576 import (
    TRAIN_KINDS,
    VQA_TYPES,
    DevSizes,
    TrainSampler576,
    distractor_hint,
    edges_agree,
    generate_dev_sets576,
    image_name,
    make_questions576,
    q_list,
    question_region,
    scene_from_record,
)
from mm_oval.zoo.model import build_tokenizer
from mm_oval.zoo.scenes import Obj, Scene, make_scene
from mm_oval.zoo.vocab import COLORS, SHAPES, vocabulary576

SMALL = DevSizes(vqa_images=6, pope_images=4, mmbench_questions=18, list_images=3)
FILES = (
    "vqav2_dev_questions.json",
    "vqav2_dev_annotations.json",
    "pope_dev.jsonl",
    "list_dev.jsonl",
    "targets.json",
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth576")
    counts = generate_dev_sets576(out, seed=0, sizes=SMALL)
    return out, counts


def _tsv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# an answer oracle written from the rules, independent of the generator's code


def _region(o: Obj) -> tuple[int, int]:
    return (math.floor(o.cy / 4) + 1, math.floor(o.cx / 4) + 1)  # 1-based, regions of 4x4 patches


def _named(objs, color, shape):
    (o,) = [x for x in objs if x.color == color and x.shape == shape]
    return o


def _alone_at(objs, r, c):
    hits = [o for o in objs if _region(o) == (r, c)]
    assert len(hits) == 1, f"region ({r}, {c}) holds {len(hits)} centres"
    return hits[0]


def oracle(objs: list[Obj], text: str, hint: str = "") -> tuple[str | list[str], list[Obj]]:
    """The answer of `text` about `objs`, and the objects it depends on (in the targets' order). Asserts the
    rules a question must satisfy to be asked."""
    if m := re.fullmatch(r"what color is the (\w+) \?", text):
        (o,) = [x for x in objs if x.shape == m[1]]
        return o.color, [o]
    if m := re.fullmatch(r"what shape is the (\w+) object \?", text):
        (o,) = [x for x in objs if x.color == m[1]]
        return o.shape, [o]
    if m := re.fullmatch(r"how many (\w+) objects are there \?", text):
        hits = [x for x in objs if x.color == m[1]]
        return str(len(hits)), hits
    if m := re.fullmatch(r"what color is the object in row (\d) column (\d) \?", text):
        o = _alone_at(objs, int(m[1]), int(m[2]))
        return o.color, [o]
    if m := re.fullmatch(r"is there a (\w+) (\w+) in the image \?", text):
        hits = [x for x in objs if x.color == m[1] and x.shape == m[2]]
        return ("yes" if hits else "no"), hits
    if m := re.fullmatch(r"is the (\w+) (\w+) (left of|above) the (\w+) (\w+) \?", text):
        a, b = _named(objs, m[1], m[2]), _named(objs, m[4], m[5])
        da, db = (a.cx, b.cx) if m[3] == "left of" else (a.cy, b.cy)
        assert abs(da - db) >= 2, text
        return ("yes" if da < db else "no"), [a, b]
    if m := re.fullmatch(r"what color is the object nearest to the (\w+) (\w+) \?", text):
        a = _named(objs, m[1], m[2])
        others = sorted((o for o in objs if o is not a), key=lambda o: math.hypot(o.cx - a.cx, o.cy - a.cy))
        d = [math.hypot(o.cx - a.cx, o.cy - a.cy) for o in others]
        assert d[1] >= 1.3 * d[0], text
        return others[0].color, [a, others[0]]
    if text == "what color is this object ?":
        m = re.fullmatch(r"the object is in row (\d) column (\d) \.", hint)
        o = _alone_at(objs, int(m[1]), int(m[2]))
        return o.color, [o]
    if m := re.fullmatch(r"what are the objects from (left to right|top to bottom) \?", text):
        key = (lambda o: o.cx) if m[1] == "left to right" else (lambda o: o.cy)
        ordered = sorted(objs, key=key)
        assert len({key(o) for o in objs}) == len(objs)  # a strict order
        return [f"{o.color} {o.shape}" for o in ordered], ordered
    raise AssertionError(f"no rule for {text!r}")


def _expected_targets(scene: Scene, deps: list[Obj]) -> list[list[int]]:
    out = []
    for o in deps:
        out += [list(p) for p in scene.members[scene.objects.index(o)]]
    return out


def _check_record(scene: Scene, text: str, t: dict, hint: str = "") -> None:
    answer, deps = oracle(scene.objects, text, hint)
    assert t["answer"] == answer, text
    assert t["targets"] == _expected_targets(scene, deps), text
    assert t["tokens"] == [r * 24 + c for r, c in t["targets"]]
    members = dict(zip(scene.objects, scene.members))
    if "nearest" in text:  # the clear-nearest rules a reader of patches can rely on
        named, near = deps
        assert near.color != named.color and near.shape != named.shape, text
        gaps = sorted(
            (min(math.hypot(c + 0.5 - named.cx, r + 0.5 - named.cy) for r, c in members[o]), o.name)
            for o in scene.objects
            if o != named
        )
        assert gaps[0][1] == near.name and gaps[1][0] >= 1.5 * gaps[0][0], text
    if text.startswith("what are the objects"):  # first member columns (rows) in the centres' order
        key = 1 if "left to right" in text else 0
        edges = [min(p[key] for p in members[o]) for o in deps]
        assert edges == sorted(edges) and len(set(edges)) == len(edges), text


def _check_distractor(scene: Scene, hint: str, deps: list[Obj]) -> None:
    m = re.fullmatch(r"the (\w+) in row (\d) column (\d) is (\w+) \.", hint)
    assert m, hint
    o = _alone_at(scene.objects, int(m[2]), int(m[3]))
    assert (o.shape, o.color) == (m[1], m[4]) and o not in deps  # true, and about another object
    assert not hint.split()[-2].isdigit()


# ------------------------------------------------------------------------------------------------
# the dev sets


def _check_dev_sets(d, vqa_images, pope_images, mmbench_questions, list_images):
    targets = json.loads((d / "targets.json").read_text())
    assert targets["meta"]["grid"] == 24 and targets["meta"]["regions"] == 6
    scenes = {k: scene_from_record(v) for k, v in targets["scenes"].items()}

    # the recorded scenes are the images
    for name, scene in scenes.items():
        if not name.startswith("mmbench-"):
            img = np.asarray(Image.open(d / "images" / name).convert("RGB"))
            assert img.shape == (336, 336, 3) and (img == np.asarray(scene.render())).all(), name

    # VQAv2
    qs = json.loads((d / "vqav2_dev_questions.json").read_text())["questions"]
    anns = json.loads((d / "vqav2_dev_annotations.json").read_text())["annotations"]
    assert len(qs) == len(anns) == 8 * vqa_images
    by_image: dict[int, list[str]] = {}
    for q, a in zip(qs, anns):
        assert (
            q["question_id"]
            == a["question_id"]
            == q["image_id"] * 1000 + len(by_image.get(q["image_id"], []))
        )
        by_image.setdefault(q["image_id"], []).append(a["question_type"])
        scene = scenes[image_name(q["image_id"])]
        t = targets["vqav2"][str(q["question_id"])]
        _check_record(scene, q["question"], t)
        assert a["multiple_choice_answer"] == t["answer"] and t["type"] == a["question_type"]
        texts = [x["answer"] for x in a["answers"]]
        assert len(texts) == 10 and texts.count(t["answer"]) >= 4
        assert a["answer_type"] == {
            "count of color": "number",
            "exists": "yes/no",
            "left of": "yes/no",
            "above": "yes/no",
        }.get(a["question_type"], "other")
    assert all(types == list(VQA_TYPES) for types in by_image.values()) and len(by_image) == vqa_images
    for qtype in ("exists", "left of", "above"):
        answers = [a["multiple_choice_answer"] for a in anns if a["question_type"] == qtype]
        assert answers.count("yes") == answers.count("no") == vqa_images // 2, qtype

    # POPE
    lines = _jsonl(d / "pope_dev.jsonl")
    assert len(lines) == 6 * pope_images
    per_image: dict[str, list] = {}
    for x in lines:
        per_image.setdefault(x["image"], []).append(x)
        scene = scenes[x["image"]]
        t = targets["pope"][str(x["question_id"])]
        _check_record(scene, x["text"], t)
        assert x["label"] == t["answer"] and t["category"] == x["category"]
    for rows in per_image.values():
        assert len({x["text"] for x in rows}) == 6
        assert sorted(x["category"] for x in rows if x["label"] == "no") == [
            "adversarial",
            "popular",
            "random",
        ]
        assert sum(x["label"] == "yes" for x in rows) == 3

    # the list task
    lines = _jsonl(d / "list_dev.jsonl")
    assert len(lines) == 2 * list_images
    for x in lines:
        assert set(x) == {"question_id", "image", "question", "answer", "order"}
        scene = scenes[x["image"]]
        assert x["question"] == f"what are the objects from {x['order']} ?"
        assert len(x["answer"]) == len(scene.objects) and sorted(x["answer"]) == sorted(
            o.name for o in scene.objects
        )
        t = targets["list"][str(x["question_id"])]
        _check_record(scene, x["question"], t)
        assert t["answer"] == x["answer"] and t["order"] == x["order"]
    assert [x["order"] for x in lines] == ["left to right", "top to bottom"] * list_images

    # MMBench
    rows = _tsv(d / "mmbench_dev.tsv")
    assert list(rows[0].keys()) == MMB_COLUMNS
    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(int(r["index"]) % CIRCULAR_OFFSET, []).append(r)
    assert len(groups) == mmbench_questions
    yes_no: dict[str, list[str]] = {}
    distractors = 0
    for base, rs in groups.items():
        t = targets["mmbench"][str(base)]
        scene = scenes[f"mmbench-{base}"]
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(rs[0]["image"]))).convert("RGB"))
        assert (img == np.asarray(scene.render())).all()
        r0 = rs[0]
        options = [r0[c] for c in "ABCD" if r0[c]]
        answer, deps = oracle(scene.objects, r0["question"], r0["hint"] if t["hint"] == "needed" else "")
        assert t["answer"] == answer and t["targets"] == _expected_targets(scene, deps)
        n = {"yes": 2, "no": 2}.get(answer, 3 if answer.isdigit() else 4)
        assert len(options) == n == len(rs) and answer in options
        assert {r[r["answer"]] for r in rs} == {answer} and len({r["answer"] for r in rs}) == n
        if answer in COLORS:
            assert set(options) <= set(COLORS)
        elif answer in SHAPES:
            assert sorted(options) == sorted(SHAPES)
        elif answer.isdigit():
            assert all(o.isdigit() and 0 <= int(o) <= 5 for o in options)
        else:
            yes_no.setdefault(t["type"], []).append(answer)
        if t["hint"] == "distractor":
            distractors += 1
            _check_distractor(scene, r0["hint"], deps)
        assert bool(r0["hint"]) == (t["hint"] != "none")
    for qtype, answers in yes_no.items():
        assert abs(answers.count("yes") - answers.count("no")) <= 1, qtype
    return distractors


def test_small_dev_sets_follow_every_rule(small):
    d, counts = small
    assert counts["vqav2"] == 48 and counts["pope"] == 24 and counts["list"] == 6
    _check_dev_sets(d, SMALL.vqa_images, SMALL.pope_images, SMALL.mmbench_questions, SMALL.list_images)


def test_committed_dev_sets_follow_every_rule_and_stay_small():
    d = bundled576_data_dir()
    distractors = _check_dev_sets(d, 40, 30, 48, 30)
    non_lookup = 48 - 48 // 9  # hint lookups are every ninth question
    assert non_lookup / 6 <= distractors <= non_lookup / 2  # about a third
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    assert size < 8.5e6
    assert len(list((d / "images").glob("*.png"))) == 100


def test_committed_dev_sets_equal_a_full_regeneration(tmp_path):
    generate_dev_sets576(tmp_path, seed=0)
    bundled = bundled576_data_dir()
    for name in FILES:
        assert (bundled / name).read_text() == (tmp_path / name).read_text(), name
    a, b = _tsv(bundled / "mmbench_dev.tsv"), _tsv(tmp_path / "mmbench_dev.tsv")
    assert [{k: v for k, v in r.items() if k != "image"} for r in a] == [
        {k: v for k, v in r.items() if k != "image"} for r in b
    ]
    names = sorted(p.name for p in (bundled / "images").glob("*.png"))
    assert names == sorted(p.name for p in (tmp_path / "images").glob("*.png"))
    for name in names[::7]:
        pa, pb = (np.asarray(Image.open(x / "images" / name)) for x in (bundled, tmp_path))
        assert (pa == pb).all(), name


def test_the_seed_changes_the_dev_sets(tmp_path, small):
    generate_dev_sets576(tmp_path, seed=1, sizes=SMALL)
    assert (tmp_path / "targets.json").read_text() != (small[0] / "targets.json").read_text()


def test_every_word_a_model_reads_or_writes_is_in_the_vocabulary(small):
    tok = build_tokenizer(vocabulary576())
    d = small[0]
    texts = []
    texts += [
        short_answer_prompt(q["question"])
        for q in json.loads((d / "vqav2_dev_questions.json").read_text())["questions"]
    ]
    texts += [
        a["multiple_choice_answer"]
        for a in json.loads((d / "vqav2_dev_annotations.json").read_text())["annotations"]
    ]
    texts += [short_answer_prompt(x["text"]) for x in _jsonl(d / "pope_dev.jsonl")]
    texts += [x["question"] + " " + " , ".join(x["answer"]) for x in _jsonl(d / "list_dev.jsonl")]
    for r in _tsv(d / "mmbench_dev.tsv"):
        texts.append(
            mmbench_prompt(r["question"], r["hint"], [r[c] for c in "ABCD" if r[c]]) + " " + r["answer"]
        )
    for i in range(20):
        for q in TrainSampler576(0).item(i, 12).questions:
            texts.append(q.hint + " " + q.text + " " + " ".join(q.options) + " " + q.answer)
    unk = tok.convert_tokens_to_ids("<unk>")
    for t in texts:
        assert unk not in tok(t, add_special_tokens=False)["input_ids"], t


# ------------------------------------------------------------------------------------------------
# the train split and make_questions576


def _mmb_answer(q):
    return q.options["ABCD".index(q.answer)] if q.options else q.answer


def test_train_sampler_answers_are_right_and_every_type_is_drawn():
    s = TrainSampler576(seed=3, mmbench_fraction=0.5)
    seen: dict[str, int] = {}
    for i in range(40):
        item = s.item(i, 16)
        assert len(item.questions) == 16 and item.image.size == (336, 336)
        assert (np.asarray(item.image) == np.asarray(item.scene.render())).all()
        yes_no: dict[str, list[str]] = {}
        for q in item.questions:
            seen[q.qtype] = seen.get(q.qtype, 0) + 1
            answer, deps = oracle(item.scene.objects, q.text, q.hint if q.qtype == "hint lookup" else "")
            if q.qtype == "list":
                assert q.answer == " , ".join(answer) and not q.options
                assert q.vqa_prompt() == f"{q.text}\n{LIST_INSTRUCTION}"
            else:
                assert _mmb_answer(q) == answer, q.text
            assert [list(p) for p in q.targets] == _expected_targets(item.scene, deps)
            if q.options and q.hint and q.qtype != "hint lookup":
                _check_distractor(item.scene, q.hint, deps)
            if answer in ("yes", "no"):
                yes_no.setdefault(q.qtype, []).append(answer)
        for answers in yes_no.values():  # alternating within an item
            assert abs(answers.count("yes") - answers.count("no")) <= 1
    assert set(seen) == set(TRAIN_KINDS)


def test_train_sampler_is_deterministic_and_seeded():
    a, b = TrainSampler576(seed=3).item(7, 12), TrainSampler576(seed=3).item(7, 12)
    assert [(q.text, q.hint, q.options, q.answer) for q in a.questions] == [
        (q.text, q.hint, q.options, q.answer) for q in b.questions
    ]
    assert (np.asarray(a.image) == np.asarray(b.image)).all()
    assert [q.text for q in TrainSampler576(seed=4).item(7, 12).questions] != [q.text for q in a.questions]
    only = TrainSampler576(
        seed=0, type_weights={"left of": 1.0, **{k: 0.0 for k in TRAIN_KINDS if k != "left of"}}
    )
    assert {q.qtype for q in only.item(0, 6).questions} == {"left of"}


def test_answer_hints_state_the_right_option_and_leave_the_default_stream_as_it_was():
    """`answer_hint_fraction`: that share of the MMBench-form questions (hint lookups aside) carries the hint
    "the answer is X ." with X the text of the answer letter's option; 0 (the default) draws exactly the items
    a sampler without the option drew (runs resume on their own data)."""
    hinted = TrainSampler576(seed=3, mmbench_fraction=1.0, answer_hint_fraction=1.0)
    plain = TrainSampler576(seed=3, mmbench_fraction=1.0)
    n = 0
    for i in range(10):
        for q in hinted.item(i, 12).questions:
            if q.qtype in ("list", "hint lookup"):
                continue
            assert q.hint == f"the answer is {_mmb_answer(q)} ." and q.hint in q.mmbench_prompt()
            n += 1
    assert n > 50
    half = TrainSampler576(seed=3, mmbench_fraction=1.0, answer_hint_fraction=0.5)
    hints = [q.hint.startswith("the answer is") for i in range(10) for q in half.item(i, 12).questions]
    assert 0.2 < sum(hints) / len(hints) < 0.6
    # the digest of these items as the sampler drew them before answer hints existed (commit 951f555)
    rows = [
        (q.qtype, q.text, q.hint, q.options, q.answer) for i in range(5) for q in plain.item(i, 12).questions
    ]
    digest = hashlib.sha256(repr(rows).encode()).hexdigest()
    assert digest == "a11e68cc730cbbb45aebaab686af8e259c99218b772de6bdfa6ba13690a92bc2"
    with pytest.raises(ConfigError, match="answer_hint_fraction"):
        TrainSampler576(seed=3, answer_hint_fraction=1.5)


def test_make_questions576_gives_one_question_of_each_allowed_type():
    rng = random.Random(5)
    for _ in range(30):
        scene = make_scene(rng)
        qs = make_questions576(scene, rng)
        assert {"count of color", "exists"} <= set(qs)
        if "list" in qs:  # asked only when the objects' first member columns (rows) keep the centres' order
            order = qs["list"].text.split("from ")[1].rstrip(" ?")
            assert edges_agree(scene, "x" if order == "left to right" else "y")
        for qtype, q in qs.items():
            assert q.qtype == qtype and not q.options
            answer, _ = oracle(scene.objects, q.text, q.hint)
            assert q.answer == (" , ".join(answer) if qtype == "list" else answer)
    # two circles in one column of regions, 8 rows apart: no unique shape, no left/right pair, no clear nearest
    scene = Scene([Obj("red", "circle", 2, 2.5, 2.5), Obj("blue", "circle", 2, 3.5, 10.5)])
    qs = make_questions576(scene, random.Random(0))
    assert set(qs) - {"list"} == {
        "shape of color",
        "count of color",
        "color at position",
        "exists",
        "above",
        "hint lookup",
    }
    assert qs["above"].answer == ("yes" if qs["above"].text.split()[2] == "red" else "no")
    assert q_list(scene, random.Random(0), "top to bottom").answer == "red circle , blue circle"


def test_regions_holding_two_centres_are_never_named():
    # the red square and the blue circle both have their centre in region (2, 2); the green cross is alone
    scene = Scene(
        [
            Obj("red", "square", 2, 4.5, 4.5),
            Obj("blue", "circle", 2, 7.5, 5.5),
            Obj("green", "cross", 3, 15.5, 15.5),
        ]
    )
    assert scene.objects[0].region == scene.objects[1].region == (1, 1)
    for seed in range(20):
        rng = random.Random(seed)
        qs = make_questions576(scene, rng)
        assert qs["color at position"].text == "what color is the object in row 4 column 4 ?"
        assert qs["hint lookup"].hint == "the object is in row 4 column 4 ."
        about_red = qs["shape of color"] if qs["shape of color"].answer == "square" else None
        if about_red is not None:
            assert distractor_hint(scene, about_red, rng) == "the cross in row 4 column 4 is green ."
    about_green = make_questions576(scene, random.Random(0))["color at position"]
    assert distractor_hint(scene, about_green, random.Random(0)) == ""  # no other object is alone


def test_question_region_frames_the_patches_of_the_region_a_question_names():
    """The frame drawn for a "row R column C" question is the 4x4-patch block of the 24x24 grid that holds
    the centre of the object the generator placed there (the answer's object)."""
    rng = random.Random(3)
    checked = 0
    for _ in range(20):
        scene = make_scene(rng)
        q = make_questions576(scene, rng).get("color at position")
        if q is None:
            continue
        top, left, bottom, right = question_region(q.text)
        assert (bottom - top, right - left) == (4, 4)
        obj = next(o for o in scene.objects if o.color == q.answer and o.region == (top // 4, left // 4))
        assert top <= obj.cy < bottom and left <= obj.cx < right
        checked += 1
    assert checked >= 10
    assert question_region("what color is the object in row 1 column 6 ?") == (0, 20, 4, 24)
    assert question_region("what color is the square ?") is None
    # one region per patch on the 64-token scenes; other grids cut at floor(k * side / regions)
    assert question_region("... row 2 column 3 ?", grid=(8, 8), regions=8) == (1, 2, 2, 3)
    assert question_region("... row 6 column 1 ?", grid=(8, 10)) == (6, 0, 8, 1)
    with pytest.raises(ConfigError, match="outside the 6x6 regions"):
        question_region("what color is the object in row 7 column 1 ?")
    with pytest.raises(ConfigError, match="regions between 1 and 4"):
        question_region("row 1 column 1", grid=(4, 4))


# ------------------------------------------------------------------------------------------------
# errors and the places that use the generator


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sizes": DevSizes(vqa_images=0)},
        {"sizes": DevSizes(list_images=-1)},
        {"sizes": DevSizes(min_objects=5, max_objects=4)},
        {"sizes": DevSizes(max_objects=13)},
        {"seed": -1},
    ],
)
def test_bad_generator_inputs_raise_clear_errors(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        generate_dev_sets576(tmp_path, **kwargs)


def test_bad_sampler_inputs_raise_clear_errors():
    with pytest.raises(ConfigError, match="mmbench_fraction"):
        TrainSampler576(0, mmbench_fraction=1.5)
    with pytest.raises(ConfigError, match="type_weights"):
        TrainSampler576(0, type_weights={"colour": 1.0})
    with pytest.raises(ConfigError, match="min_objects"):
        TrainSampler576(0, min_objects=0)
    with pytest.raises(ConfigError, match="order"):
        q_list(make_scene(random.Random(0)), random.Random(0), "right to left")


def test_cli_generates_the_576_benchmark_and_keeps_64_the_default(tmp_path, capsys):
    argv = ["zoo", "generate", "--out", str(tmp_path / "g"), "--vqa-images", "2", "--pope-images", "1"]
    assert main([*argv, "--geometry", "576", "--mmbench-questions", "3", "--list-images", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["list"] == 2
    assert len(_jsonl(tmp_path / "g" / "list_dev.jsonl")) == 2
    assert main([*argv, "--mmbench-questions", "3", "--out", str(tmp_path / "h")]) == 0
    assert json.loads((tmp_path / "h" / "targets.json").read_text())["meta"]["grid"] == 8
    assert main([*argv, "--list-images", "1", "--out", str(tmp_path / "i")]) == 2
    assert "--geometry 576" in capsys.readouterr().err


def test_bundled576_names_the_committed_folder():
    assert resolve_data("bundled576") == bundled576_data_dir()
    assert (bundled576_data_dir() / "list_dev.jsonl").is_file()


def test_zoo576_specs_draw_from_the_576_train_split():
    samples = load_samples("zoo576:train:3", followups=1)
    assert [s.sample_id for s in samples] == [f"zoo576-train-0-{i}" for i in range(3)]
    assert all(s.images[0].size == (336, 336) and len(s.followups) == 1 for s in samples)
    held = load_samples("zoo576:heldout:3")
    assert [s.question for s in held] != [s.question for s in samples]
    assert load_samples("zoo:train:1")[0].images[0].size == (128, 128)  # the 64-token form is unchanged
    prompts = load_prompts("zoo576:2")
    assert len(prompts) == 2 and prompts[0].image.size == (336, 336)
