"""The 576-token bundled benchmark: scenes at LLaVA-1.5's geometry (`scenes.py`: 336x336 images, 24x24
patches of 14 px, objects covering several patches) and questions about them, written in the real MMBench
(TSV), VQAv2 (questions + annotations JSON) and POPE (JSONL) formats, plus a long-answer list file.

Questions speak of the 6x6 grid of regions (4x4 patches each, numbered 1..6, row 1 at the top, column 1 at
the left); an object is in the region holding its centre, and only regions holding exactly one centre are
named. Relations compare centres: `left of` / `above` only for objects whose centres are at least
`MIN_GAP` patches apart along that axis, `nearest to` only when the second nearest object is at least
`NEAREST_RATIO` times as far as the nearest. The question texts are fixed templates (words separated by
single spaces) that a reader can parse by word offset.

A question's targets are the member patches (`Scene.members`) of every object its answer depends on, 0-based
(row, col); the image-token index is row * 24 + col.

Everything is a pure function of the seed: `generate_dev_sets576(out, seed)` writes the committed dev sets
(eval/data/synth576), `TrainSampler576` draws the (never bundled) train split on the fly.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from ..files import atomic_write_bytes, atomic_write_text
from ..prompts import list_prompt
from .generate import (
    COLOR_AT,
    COLOR_OF_SHAPE,
    COUNT,
    EXISTS,
    HINT_LOOKUP,
    LETTERS,
    MMB_CATEGORY,
    SHAPE_OF_COLOR,
    Question,
    TrainItem,
    _absent_pair,
    check_sampler_options,
    image_name,
    mmbench_rows,
    pope_line,
    vqa_records,
    write_mmbench_tsv,
    write_vqa_files,
)
from .scenes import (
    GRID,
    IMAGE_SIZE,
    MAX_OBJECTS,
    MAX_PER_COLOR,
    PATCH,
    REGION_PATCHES,
    REGIONS,
    Obj,
    Scene,
    make_scene,
)
from .vocab import COLORS, SHAPES

log = logging.getLogger(__name__)

# the question types beyond the 64-token benchmark's (VQA question_type / targets.json "type")
LEFT_OF = "left of"
ABOVE = "above"
NEAREST = "nearest to"
LIST = "list"
VQA_TYPES = (COLOR_OF_SHAPE, SHAPE_OF_COLOR, COUNT, COLOR_AT, EXISTS, LEFT_OF, ABOVE, NEAREST)
MMB_TYPES = (*VQA_TYPES, HINT_LOOKUP)
TRAIN_KINDS = (*MMB_TYPES, LIST)
YES_NO_TYPES = (EXISTS, LEFT_OF, ABOVE)
ANSWER_TYPE = {
    COLOR_OF_SHAPE: "other",
    SHAPE_OF_COLOR: "other",
    COUNT: "number",
    COLOR_AT: "other",
    EXISTS: "yes/no",
    LEFT_OF: "yes/no",
    ABOVE: "yes/no",
    NEAREST: "other",
}
MMB_CATEGORY576 = {
    **MMB_CATEGORY,
    LEFT_OF: ("spatial_relation", "relation_reasoning"),
    ABOVE: ("spatial_relation", "relation_reasoning"),
    NEAREST: ("nearest_object", "relation_reasoning"),
}
NEGATIVE_KINDS = ("random", "popular", "adversarial")  # POPE's negative samplings
ORDERS = ("left to right", "top to bottom")
MIN_GAP = 2.0  # patches between centres for left of / above
NEAREST_RATIO = 1.3  # second nearest at least this many times as far as the nearest
PATCH_RATIO = 1.5  # the same, measured to each object's nearest member patch
DISTRACTOR_FRACTION = 1 / 3  # MMBench questions (other than hint lookups) with a distractor hint

Patch = tuple[int, int]


class ListQuestion(Question):
    """A long-answer question: the answer is the listed objects joined by " , " (the word-level
    tokenizer's spelling); its prompt ends in the list instruction instead of the short-answer one."""

    def vqa_prompt(self) -> str:
        return list_prompt(self.text)


# ------------------------------------------------------------------------------------------------
# what the rules allow in a scene


def alone_in_region(scene: Scene) -> list[Obj]:
    """The objects whose region holds no other object's centre (the only ones a question places by region)."""
    regions = [o.region for o in scene.objects]
    return [o for o in scene.objects if regions.count(o.region) == 1]


def region_words(o: Obj) -> str:
    r, c = o.region
    return f"row {r + 1} column {c + 1}"


_REGION_WORDS = re.compile(r"\brow (\d+) column (\d+)\b")


def question_region(
    question: str, grid: tuple[int, int] = (GRID, GRID), regions: int = REGIONS
) -> tuple[int, int, int, int] | None:
    """The patches of the region a question names in `region_words`' words ("... in row R column C ?",
    1-based, row 1 at the top), on a grid of `grid` (rows, cols) patches cut into `regions` x `regions`
    regions: (top, left, bottom, right) in patches, bottom and right exclusive. On the bundled 576-token
    scenes a region is 4x4 patches of the 24x24 grid; with as many regions as patches per side (the
    64-token scenes: 8) it is one patch; other grids are cut at floor(k * side / regions). None when the
    question names no region; a ConfigError when R or C is not in 1..regions."""
    rows, cols = grid
    if regions < 1 or rows < regions or cols < regions:
        raise ConfigError(
            f"a grid of {rows}x{cols} patches cannot be cut into {regions}x{regions} regions: "
            f"pass regions between 1 and {min(rows, cols)}"
        )
    found = _REGION_WORDS.search(question)
    if found is None:
        return None
    r, c = int(found[1]) - 1, int(found[2]) - 1
    if not (0 <= r < regions and 0 <= c < regions):
        raise ConfigError(
            f"the question {question!r} names row {r + 1} column {c + 1}, outside the {regions}x{regions} "
            f"regions (1..{regions}); pass the number of regions per side its scenes use as regions="
        )
    return (r * rows // regions, c * cols // regions, (r + 1) * rows // regions, (c + 1) * cols // regions)


def nearest_other(scene: Scene, obj: Obj) -> Obj | None:
    """The object nearest to `obj` (Euclidean distance between centres), asked only when it is clear: the
    second nearest is at least NEAREST_RATIO times as far; the object owning the member patch nearest to
    `obj`'s centre is the same one, the second object's nearest patch at least PATCH_RATIO times as far;
    and it has another colour and another shape than `obj` (a reader may set aside what shares either).
    None otherwise."""
    others = sorted(
        (math.dist((o.cx, o.cy), (obj.cx, obj.cy)), i) for i, o in enumerate(scene.objects) if o != obj
    )
    if len(others) < 2 or others[1][0] < NEAREST_RATIO * others[0][0]:
        return None
    near = scene.objects[others[0][1]]
    if near.color == obj.color or near.shape == obj.shape:
        return None
    by_patch = sorted(
        (min(math.dist((c + 0.5, r + 0.5), (obj.cx, obj.cy)) for r, c in mem), i)
        for i, (o, mem) in enumerate(zip(scene.objects, scene.members, strict=True))
        if o != obj
    )
    if by_patch[0][1] != others[0][1] or by_patch[1][0] < PATCH_RATIO * by_patch[0][0]:
        return None
    return near


def edges_agree(scene: Scene, axis: str) -> bool:
    """Whether ordering the objects by their member patches' first column (axis "x") or row ("y") gives
    the centres' order, with no two objects sharing that edge (what a list question asks for)."""
    key = 1 if axis == "x" else 0
    edges = [min(p[key] for p in mem) for mem in scene.members]
    centres = [o.cx if axis == "x" else o.cy for o in scene.objects]
    by_edge = sorted(range(len(edges)), key=lambda i: edges[i])
    by_centre = sorted(range(len(centres)), key=lambda i: centres[i])
    return len(set(edges)) == len(edges) and by_edge == by_centre


def relation_pairs(scene: Scene, axis: str) -> list[tuple[Obj, Obj]]:
    """Unordered pairs (a before b in scene order) whose centres are >= MIN_GAP apart along `axis` ("x"/"y")."""
    key = (lambda o: o.cx) if axis == "x" else (lambda o: o.cy)
    objs = scene.objects
    return [(a, b) for i, a in enumerate(objs) for b in objs[i + 1 :] if abs(key(a) - key(b)) >= MIN_GAP]


def _patches(scene: Scene, objs: list[Obj]) -> list[Patch]:
    """The member patches of `objs`, object by object in the order given."""
    out: list[Patch] = []
    for o in objs:
        out.extend(scene.members[scene.objects.index(o)])
    return out


# ------------------------------------------------------------------------------------------------
# one maker per question type: a Question, or None when the scene does not allow the type


def q_color_of_shape(scene: Scene, rng: random.Random) -> Question | None:
    unique = [s for s in SHAPES if sum(o.shape == s for o in scene.objects) == 1]
    if not unique:
        return None
    shape = rng.choice(unique)
    obj = next(o for o in scene.objects if o.shape == shape)
    text = f"what color is the {shape} ?"
    return Question(COLOR_OF_SHAPE, text, obj.color, _patches(scene, [obj]), keys=[("q", 4), ("q", 4)])


def q_shape_of_color(scene: Scene, rng: random.Random) -> Question | None:
    unique = [c for c in COLORS if sum(o.color == c for o in scene.objects) == 1]
    if not unique:
        return None
    color = rng.choice(unique)
    obj = next(o for o in scene.objects if o.color == color)
    text = f"what shape is the {color} object ?"
    return Question(SHAPE_OF_COLOR, text, obj.shape, _patches(scene, [obj]), keys=[("q", 4), ("q", 4)])


def q_count(scene: Scene, rng: random.Random) -> Question | None:
    present = sorted({o.color for o in scene.objects})
    absent = [c for c in COLORS if c not in present]
    # mostly colours that are present (counts 1..5), sometimes an absent one (count 0)
    color = rng.choice(absent) if absent and rng.random() < 0.15 else rng.choice(present)
    objs = [o for o in scene.objects if o.color == color]
    text = f"how many {color} objects are there ?"
    return Question(COUNT, text, str(len(objs)), _patches(scene, objs), keys=[("q", 2), ("q", 2)])


def q_color_at(scene: Scene, rng: random.Random) -> Question | None:
    alone = alone_in_region(scene)
    if not alone:
        return None
    obj = rng.choice(alone)
    text = f"what color is the object in {region_words(obj)} ?"
    return Question(COLOR_AT, text, obj.color, _patches(scene, [obj]), keys=[("q", 7), ("q", 9)])


def exists_text(color: str, shape: str) -> str:
    return f"is there a {color} {shape} in the image ?"


def q_exists(
    scene: Scene,
    rng: random.Random,
    answer: str | None = None,
    kind: str | None = None,
    avoid: set | None = None,
) -> Question | None:
    """`answer` yes/no (default: a coin flip); a no names an absent (colour, shape) drawn `kind`
    (random / popular / adversarial, as POPE samples its negatives; default: one of them at random)."""
    answer = answer or rng.choice(["yes", "no"])
    if answer == "yes":
        obj = rng.choice(scene.objects)
        color, shape, targets = obj.color, obj.shape, _patches(scene, [obj])
    else:
        pair = _absent_pair(scene, rng, kind or rng.choice(NEGATIVE_KINDS), avoid)  # type: ignore[arg-type]
        if pair is None:
            return None
        (color, shape), targets = pair, []
    return Question(EXISTS, exists_text(color, shape), answer, targets, keys=[("q", 3), ("q", 4)])


def _relation(scene: Scene, rng: random.Random, qtype: str, answer: str | None) -> Question | None:
    axis, word = ("x", "left of") if qtype == LEFT_OF else ("y", "above")
    pairs = relation_pairs(scene, axis)
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    first_smaller = (a.cx < b.cx) if axis == "x" else (a.cy < b.cy)
    answer = answer or rng.choice(["yes", "no"])
    if first_smaller != (answer == "yes"):
        a, b = b, a
    text = f"is the {a.name} {word} the {b.name} ?"
    keys = [("q", 2), ("q", 3), ("q", 7 if axis == "x" else 6), ("q", 8 if axis == "x" else 7)]
    return Question(qtype, text, answer, _patches(scene, [a, b]), keys=keys)


def q_left_of(scene: Scene, rng: random.Random, answer: str | None = None) -> Question | None:
    return _relation(scene, rng, LEFT_OF, answer)


def q_above(scene: Scene, rng: random.Random, answer: str | None = None) -> Question | None:
    return _relation(scene, rng, ABOVE, answer)


def q_nearest(scene: Scene, rng: random.Random) -> Question | None:
    clear = [(o, n) for o in scene.objects if (n := nearest_other(scene, o)) is not None]
    if not clear:
        return None
    obj, near = rng.choice(clear)
    text = f"what color is the object nearest to the {obj.name} ?"
    return Question(NEAREST, text, near.color, _patches(scene, [obj, near]), keys=[("q", 8), ("q", 9)])


def q_hint_lookup(scene: Scene, rng: random.Random) -> Question | None:
    """MMBench only: the hint names the region; the question cannot be answered without it."""
    alone = alone_in_region(scene)
    if not alone:
        return None
    obj = rng.choice(alone)
    hint = f"the object is in {region_words(obj)} ."
    return Question(
        HINT_LOOKUP,
        "what color is this object ?",
        obj.color,
        _patches(scene, [obj]),
        hint=hint,
        keys=[("hint", 5), ("hint", 7)],
    )


def q_list(scene: Scene, rng: random.Random, order: str | None = None) -> ListQuestion | None:
    """Every object of the scene in `order` (left to right / top to bottom; default: either), by their
    centres; None unless the objects' first member columns (rows) give the same order (`edges_agree`)."""
    order = order or rng.choice(ORDERS)
    if order not in ORDERS:
        raise ConfigError(f"list order must be one of {list(ORDERS)}, got {order!r}")
    if not edges_agree(scene, "x" if order == ORDERS[0] else "y"):
        return None
    objs = scene.left_to_right() if order == ORDERS[0] else scene.top_to_bottom()
    text = f"what are the objects from {order} ?"
    return ListQuestion(LIST, text, " , ".join(o.name for o in objs), _patches(scene, objs))


def list_items(q: Question) -> list[str]:
    """The items of a list question's answer ("red circle , blue square" -> ["red circle", "blue square"])."""
    return q.answer.split(" , ")


QUESTION_MAKERS: dict[str, Callable[..., Question | None]] = {
    COLOR_OF_SHAPE: q_color_of_shape,
    SHAPE_OF_COLOR: q_shape_of_color,
    COUNT: q_count,
    COLOR_AT: q_color_at,
    EXISTS: q_exists,
    LEFT_OF: q_left_of,
    ABOVE: q_above,
    NEAREST: q_nearest,
    HINT_LOOKUP: q_hint_lookup,
    LIST: q_list,
}


def make_questions576(scene: Scene, rng: random.Random) -> dict[str, Question]:
    """One question of each type the scene allows (the VQA types, hint lookup and a list question in a
    random order), in TRAIN_KINDS order; yes/no answers and the negative kind are drawn at random."""
    out = {}
    for qtype in TRAIN_KINDS:
        q = QUESTION_MAKERS[qtype](scene, rng)
        if q is not None:
            out[qtype] = q
    return out


# ------------------------------------------------------------------------------------------------
# multiple choice


def distractor_hint(scene: Scene, q: Question, rng: random.Random) -> str:
    """A true statement about an object the answer does not depend on and that is alone in its region,
    naming a colour and a shape the answer must not copy ("" when there is none)."""
    used = set(q.targets)
    others = [o for o in alone_in_region(scene) if not used & set(scene.members[scene.objects.index(o)])]
    if not others:
        return ""
    o = rng.choice(others)
    return f"the {o.shape} in {region_words(o)} is {o.color} ."


def answer_hint(q: Question) -> str:
    """A hint that states a multiple-choice question's answer in words (its option's text)."""
    return f"the answer is {q.options[LETTERS.index(q.answer)]} ."


def to_mmbench(scene: Scene, q: Question, rng: random.Random, hint_mode: str = "none") -> Question:
    """Turn a question into a multiple-choice one: 2 options (yes/no), 3 (counts, 0..MAX_PER_COLOR) or 4
    (colours, shapes)."""
    if q.answer in ("yes", "no"):
        options = ["yes", "no"]
    elif q.answer.isdigit():
        pool = [str(i) for i in range(MAX_PER_COLOR + 1) if str(i) != q.answer]
        options = [q.answer, *rng.sample(pool, 2)]
    elif q.answer in COLORS:
        options = [q.answer, *rng.sample([c for c in COLORS if c != q.answer], 3)]
    else:
        options = list(SHAPES)
    rng.shuffle(options)
    hint = q.hint
    if not hint and hint_mode == "distractor":
        hint = distractor_hint(scene, q, rng)
    return Question(q.qtype, q.text, LETTERS[options.index(q.answer)], q.targets, hint, options, q.keys)


# ------------------------------------------------------------------------------------------------
# writing the dev sets


@dataclass
class DevSizes:
    vqa_images: int = 40  # x one question of each of the 8 VQA types = 320 questions
    pope_images: int = 30  # x 6 questions (3 yes; random / popular / adversarial no) = 180
    mmbench_questions: int = 48  # base questions over the 9 MMBench types; rotations are extra rows
    list_images: int = 30  # x 2 list questions (left to right, top to bottom) = 60
    min_objects: int = 4
    max_objects: int = MAX_OBJECTS

    def validate(self) -> None:
        for name in ("vqa_images", "pope_images", "mmbench_questions", "list_images"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 3 <= self.min_objects <= self.max_objects <= MAX_OBJECTS:
            raise ConfigError(
                f"dev scenes need 3 <= min_objects <= max_objects <= {MAX_OBJECTS} (a POPE image holds 3 "
                f"yes-questions), got {self.min_objects}..{self.max_objects}"
            )


def _scene_with(
    rng: random.Random, sizes: DevSizes, makers: list[Callable[[Scene], Question | None]]
) -> tuple[Scene, list[Question]]:
    """Draw scenes until every maker has a question about one."""
    for _ in range(1000):
        scene = make_scene(rng, sizes.min_objects, sizes.max_objects)
        qs = [m(scene) for m in makers]
        if all(q is not None for q in qs):
            return scene, qs  # type: ignore[return-value]
    raise ConfigError(
        f"could not draw a scene allowing every question type with {sizes.min_objects}..{sizes.max_objects} "
        "objects; raise max_objects"
    )


def _maker(qtype: str, rng: random.Random, answer: str | None = None, kind: str | None = None):
    """A one-argument maker for `qtype`, with the yes/no answer (and the negative kind) fixed."""
    if qtype == EXISTS:
        return lambda s: q_exists(s, rng, answer, kind)
    if qtype in (LEFT_OF, ABOVE):
        return lambda s: _relation(s, rng, qtype, answer)
    return lambda s: QUESTION_MAKERS[qtype](s, rng)


def scene_record(scene: Scene) -> dict:
    """The scene as JSON (objects and texture seed): `scene_from_record` rebuilds it, pixel for pixel."""
    objs = [
        {"color": o.color, "shape": o.shape, "size": o.size, "cx": o.cx, "cy": o.cy} for o in scene.objects
    ]
    return {"texture_seed": scene.texture_seed, "objects": objs}


def scene_from_record(rec: dict) -> Scene:
    return Scene([Obj(**o) for o in rec["objects"]], texture_seed=rec["texture_seed"])


def _target_record(q: Question, **extra) -> dict:
    return {
        "type": q.qtype,
        "answer": q.answer,
        "targets": [list(p) for p in q.targets],
        "tokens": [r * GRID + c for r, c in q.targets],
        **extra,
    }


def generate_dev_sets576(out: str | Path, seed: int = 0, sizes: DevSizes | None = None) -> dict[str, int]:
    """Write the dev sets under `out` (images/, vqav2_dev_*.json, pope_dev.jsonl, mmbench_dev.tsv,
    list_dev.jsonl, targets.json). Deterministic per seed. Returns the number of items written per file."""
    sizes = sizes or DevSizes()
    sizes.validate()
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out)
    rng = random.Random(f"mm-oval-synth576-dev-{seed}")
    targets: dict[str, dict[str, dict]] = {"vqav2": {}, "pope": {}, "mmbench": {}, "list": {}}
    scenes: dict[str, dict] = {}  # image file name (MMBench: "mmbench-<index>") -> scene_record
    image_id = 1

    # VQAv2: one question of each type per image, in VQA_TYPES order; the yes/no types alternate their
    # answer from image to image (exactly balanced for an even number of images), exists cycles its
    # negative kind
    questions, annotations = [], []
    for i in range(sizes.vqa_images):
        answer = "yes" if i % 2 == 0 else "no"
        kind = NEGATIVE_KINDS[(i // 2) % len(NEGATIVE_KINDS)]
        makers = [_maker(t, rng, answer, kind) for t in VQA_TYPES]
        scene, qs = _scene_with(rng, sizes, makers)
        atomic_write_bytes(out / "images" / image_name(image_id), scene.png_bytes())
        scenes[image_name(image_id)] = scene_record(scene)
        for k, q in enumerate(qs):
            qid = image_id * 1000 + k
            question, annotation = vqa_records(qid, image_id, q, ANSWER_TYPE[q.qtype], rng)
            questions.append(question)
            annotations.append(annotation)
            targets["vqav2"][str(qid)] = _target_record(q)
        image_id += 1
    info = {"description": "mm-oval synthetic 576-token VQAv2-format dev set", "version": "1.0", "seed": seed}
    write_vqa_files(out, info, "synth576", questions, annotations)

    # POPE: 3 yes and 3 no (random, popular, adversarial negatives) per image, on new images
    pope_lines = []
    qid = 1
    for _ in range(sizes.pope_images):
        for _attempt in range(1000):
            scene = make_scene(rng, sizes.min_objects, sizes.max_objects)
            used: set[tuple[str, str]] = set()
            negs = []
            for kind in NEGATIVE_KINDS:
                q = q_exists(scene, rng, "no", kind, avoid=used)
                negs.append(q)
                if q is not None:
                    used.add(tuple(q.text.split()[3:5]))
            if len(scene.objects) >= 3 and all(negs):
                break
        else:  # pragma: no cover - a scene of 3.. objects always leaves absent pairs
            raise ConfigError("could not draw a POPE scene")
        atomic_write_bytes(out / "images" / image_name(image_id), scene.png_bytes())
        scenes[image_name(image_id)] = scene_record(scene)
        present = rng.sample(scene.objects, 3)
        items = [
            (
                Question(
                    EXISTS,
                    exists_text(o.color, o.shape),
                    "yes",
                    _patches(scene, [o]),
                    keys=[("q", 3), ("q", 4)],
                ),
                kind,
            )
            for o, kind in zip(present, NEGATIVE_KINDS)
        ]
        items += [(q, kind) for q, kind in zip(negs, NEGATIVE_KINDS)]
        rng.shuffle(items)
        for q, kind in items:
            pope_lines.append(pope_line(qid, image_name(image_id), q, kind))
            targets["pope"][str(qid)] = _target_record(q, category=kind)
            qid += 1
        image_id += 1
    atomic_write_text(out / "pope_dev.jsonl", "\n".join(pope_lines) + "\n")

    # the list task: both orders on each image, on new images
    list_lines = []
    list_makers = [lambda sc, o=o: q_list(sc, rng, o) for o in ORDERS]
    for _ in range(sizes.list_images):
        scene, list_qs = _scene_with(rng, sizes, list_makers)
        atomic_write_bytes(out / "images" / image_name(image_id), scene.png_bytes())
        scenes[image_name(image_id)] = scene_record(scene)
        for k, (order, q) in enumerate(zip(ORDERS, list_qs, strict=True)):
            qid = image_id * 1000 + k
            items = list_items(q)
            list_lines.append(
                json.dumps(
                    {
                        "question_id": qid,
                        "image": image_name(image_id),
                        "question": q.text,
                        "answer": items,
                        "order": order,
                    }
                )
            )
            targets["list"][str(qid)] = {**_target_record(q), "answer": items, "order": order}
        image_id += 1
    atomic_write_text(out / "list_dev.jsonl", "\n".join(list_lines) + "\n")

    # MMBench: multiple choice with circular rotations; a ninth of the questions need their hint (hint
    # lookup), about a third of the others carry a distractor hint; each yes/no type alternates its answer
    rows = []
    seen: dict[str, int] = {}
    for base in range(sizes.mmbench_questions):
        qtype = MMB_TYPES[base % len(MMB_TYPES)]
        answer = "yes" if seen.get(qtype, 0) % 2 == 0 else "no"
        seen[qtype] = seen.get(qtype, 0) + 1
        scene, (q,) = _scene_with(rng, sizes, [_maker(qtype, rng, answer)])
        distract = qtype != HINT_LOOKUP and rng.random() < DISTRACTOR_FRACTION
        mq = to_mmbench(scene, q, rng, hint_mode="distractor" if distract else "none")
        b64 = base64.b64encode(scene.png_bytes()).decode("ascii")
        scenes[f"mmbench-{base}"] = scene_record(scene)
        rows += mmbench_rows(base, mq, b64, *MMB_CATEGORY576[qtype], source="synth576")
        targets["mmbench"][str(base)] = _target_record(
            q,
            answer=mq.options[LETTERS.index(mq.answer)],
            hint="needed" if qtype == HINT_LOOKUP else ("distractor" if mq.hint else "none"),
        )
    write_mmbench_tsv(out, rows)

    meta = {
        "seed": seed,
        "grid": GRID,
        "regions": REGIONS,
        "region_patches": REGION_PATCHES,
        "patch_px": PATCH,
        "image_size": IMAGE_SIZE,
        "targets_are": (
            f"member patches of the objects the answer depends on, 0-based (row, col); tokens = image-token "
            f"index row * {GRID} + col; questions number regions of {REGION_PATCHES}x{REGION_PATCHES} patches "
            f"1..{REGIONS}"
        ),
        "scenes_are": "per image file (MMBench: mmbench-<index>): texture seed and objects (colour, shape, "
        "box side in patches, centre cx, cy in patch units)",
    }
    atomic_write_text(out / "targets.json", json.dumps({"meta": meta, **targets, "scenes": scenes}, indent=0))
    counts = {
        "vqav2": len(questions),
        "pope": len(pope_lines),
        "list": len(list_lines),
        "mmbench_rows": len(rows),
        "mmbench_questions": sizes.mmbench_questions,
    }
    log.info("wrote %s to %s", counts, out)
    return counts


# ------------------------------------------------------------------------------------------------
# the train split, drawn on the fly


class TrainSampler576:
    """Draws training scenes with many questions each: every type (VQA-style and MMBench-style, list
    questions in either order). Within an item the yes/no questions of each type alternate yes and no (from
    a random start), so they are balanced. Seeded: the same (seed, index) gives the same item."""

    def __init__(
        self,
        seed: int,
        min_objects: int = 4,
        max_objects: int = MAX_OBJECTS,
        mmbench_fraction: float = 0.3,
        type_weights: dict[str, float] | None = None,
        answer_hint_fraction: float = 0.0,
    ):
        check_sampler_options(mmbench_fraction, type_weights, TRAIN_KINDS)
        if not 0.0 <= answer_hint_fraction <= 1.0:
            raise ConfigError(f"answer_hint_fraction must be in [0, 1], got {answer_hint_fraction}")
        # the share of MMBench-form questions (hint lookups aside) whose hint states the answer: a lesson in
        # mapping an answer to its option's letter without having to find the answer in the image first
        self.answer_hint_fraction = answer_hint_fraction
        self.type_weights = [float((type_weights or {}).get(k, 1.0)) for k in TRAIN_KINDS]
        if not any(self.type_weights):
            raise ConfigError("type_weights: at least one type needs a positive weight")
        make_scene(random.Random(0), min_objects, max_objects)  # validates the counts
        self.seed, self.min_objects, self.max_objects = seed, min_objects, max_objects
        self.mmbench_fraction = mmbench_fraction

    def item(self, index: int, n_questions: int) -> TrainItem:
        rng = random.Random(f"mm-oval-synth576-train-{self.seed}-{index}")
        scene = make_scene(rng, self.min_objects, self.max_objects)
        next_yes = {t: rng.random() < 0.5 for t in YES_NO_TYPES}
        questions: list[Question] = []
        tries = 0
        while len(questions) < n_questions and tries < 20 * n_questions:
            tries += 1
            qtype = rng.choices(TRAIN_KINDS, weights=self.type_weights)[0]
            if qtype == HINT_LOOKUP and rng.random() > self.mmbench_fraction:
                continue
            if qtype in YES_NO_TYPES:
                q = _maker(qtype, rng, "yes" if next_yes[qtype] else "no")(scene)
                if q is not None:
                    next_yes[qtype] = not next_yes[qtype]
            else:
                q = QUESTION_MAKERS[qtype](scene, rng)
            if q is None:
                continue
            if qtype == HINT_LOOKUP or (qtype != LIST and rng.random() < self.mmbench_fraction):
                distract = qtype != HINT_LOOKUP and rng.random() < DISTRACTOR_FRACTION
                q = to_mmbench(scene, q, rng, hint_mode="distractor" if distract else "none")
                # drawn only when asked for, so that a sampler without answer hints draws the stream it always did
                if (
                    self.answer_hint_fraction
                    and qtype != HINT_LOOKUP
                    and rng.random() < self.answer_hint_fraction
                ):
                    q = replace(q, hint=answer_hint(q))
            questions.append(q)
        return TrainItem(scene, scene.render(), questions)
