"""The bundled synthetic benchmark: seeded scenes of coloured shapes on an 8x8 grid, and questions whose
answers need the image, written in the real MMBench (TSV), VQAv2 (questions + annotations JSON) and POPE
(JSONL) formats.

A scene is a 128x128 image cut into 8x8 cells of 16 px; each cell holds at most one object, so one
cell is exactly one image token (patch) of the tiny LLaVA. Rows and columns are numbered 1..8 in the
questions (row 1 at the top, column 1 at the left); targets are stored 0-based as (row, col), patch
index row * 8 + col.

Everything is a pure function of the seed: `generate_dev_sets(out, seed)` writes the committed dev sets,
`TrainSampler` draws the (never bundled) train split on the fly.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from ..errors import ConfigError
from ..files import atomic_write_bytes, atomic_write_text
from ..prompts import (
    MMBENCH_INSTRUCTION,
    OPTION_LETTERS,
    SHORT_ANSWER_PROMPT,
    mmbench_prompt,
    short_answer_prompt,
)
from .vocab import COLORS, NUMBER_WORDS, SHAPES

log = logging.getLogger(__name__)

GRID = 8
CELL = 16
IMAGE_SIZE = GRID * CELL
BACKGROUND = (0, 0, 0)
RGB = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (40, 80, 235),
    "yellow": (240, 225, 30),
    "purple": (140, 40, 190),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
    "pink": (250, 150, 205),
}
assert set(RGB) == set(COLORS)

# the LLaVA-1.5 evaluation prompts (the harness builds exactly these; training uses them too)
VQA_SUFFIX = "\n" + SHORT_ANSWER_PROMPT
MMB_SUFFIX = "\n" + MMBENCH_INSTRUCTION
LETTERS = "".join(OPTION_LETTERS)

# question types (VQA question_type / targets.json "type"); MMBench adds "hint lookup"
COLOR_OF_SHAPE = "color of shape"
SHAPE_OF_COLOR = "shape of color"
COUNT = "count of color"
COLOR_AT = "color at position"
EXISTS = "exists"
HINT_LOOKUP = "hint lookup"
VQA_TYPES = (COLOR_OF_SHAPE, SHAPE_OF_COLOR, COUNT, COLOR_AT, EXISTS)
# the training draw: every VQA type, exists once more (balanced yes/no items), and hint lookups
TRAIN_KINDS = (*VQA_TYPES, EXISTS, HINT_LOOKUP)
ANSWER_TYPE = {
    COLOR_OF_SHAPE: "other",
    SHAPE_OF_COLOR: "other",
    COUNT: "number",
    COLOR_AT: "other",
    EXISTS: "yes/no",
}
MMB_CATEGORY = {
    COLOR_OF_SHAPE: ("color_recognition", "finegrained_perception (instance-level)"),
    SHAPE_OF_COLOR: ("shape_recognition", "finegrained_perception (instance-level)"),
    COUNT: ("counting", "finegrained_perception (cross-instance)"),
    COLOR_AT: ("spatial_lookup", "finegrained_perception (cross-instance)"),
    EXISTS: ("existence", "coarse_perception"),
    HINT_LOOKUP: ("hint_lookup", "logic_reasoning"),
}
MMB_COLUMNS = [
    "index", "question", "hint", "A", "B", "C", "D", "answer", "category", "image",
    "source", "l2-category", "comment", "split",
]  # fmt: skip
CIRCULAR_OFFSET = 1_000_000


@dataclass(frozen=True)
class Obj:
    row: int  # 0-based
    col: int
    color: str
    shape: str


@dataclass
class Scene:
    objects: list[Obj]

    def render(self) -> Image.Image:
        img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
        draw = ImageDraw.Draw(img)
        for o in self.objects:
            x, y, fill = o.col * CELL, o.row * CELL, RGB[o.color]
            if o.shape == "circle":
                draw.ellipse([x + 2, y + 2, x + 13, y + 13], fill=fill)
            elif o.shape == "square":
                draw.rectangle([x + 3, y + 3, x + 12, y + 12], fill=fill)
            elif o.shape == "triangle":
                draw.polygon([(x + 8, y + 2), (x + 14, y + 13), (x + 1, y + 13)], fill=fill)
            elif o.shape == "cross":
                draw.rectangle([x + 2, y + 6, x + 13, y + 9], fill=fill)
                draw.rectangle([x + 6, y + 2, x + 9, y + 13], fill=fill)
            else:  # pragma: no cover - shapes come from SHAPES
                raise ConfigError(f"unknown shape {o.shape!r}")
        return img

    def at(self, row: int, col: int) -> Obj | None:
        for o in self.objects:
            if o.row == row and o.col == col:
                return o
        return None


def make_scene(rng: random.Random, min_objects: int = 3, max_objects: int = 8) -> Scene:
    """A scene of min..max objects in distinct cells, colours and shapes drawn uniformly."""
    if not 1 <= min_objects <= max_objects <= GRID * GRID:
        raise ConfigError(
            f"object counts must satisfy 1 <= min_objects <= max_objects <= {GRID * GRID}, "
            f"got min_objects={min_objects}, max_objects={max_objects}"
        )
    n = rng.randint(min_objects, max_objects)
    cells = rng.sample(range(GRID * GRID), n)
    return Scene([Obj(c // GRID, c % GRID, rng.choice(COLORS), rng.choice(SHAPES)) for c in cells])


@dataclass
class Question:
    """One question about a scene: text without the evaluation suffix, canonical answer, target cells."""

    qtype: str
    text: str
    answer: str
    targets: list[tuple[int, int]]
    hint: str = ""
    options: list[str] = field(default_factory=list)  # MMBench only; answer is then a letter
    # where the question's two key words are, as (segment "q" or "hint", word index in that segment):
    # what a reader must look up in the image (used by the trainer's attention teacher)
    keys: list[tuple[str, int]] = field(default_factory=list)

    def mmbench_prompt(self) -> str:
        return mmbench_prompt(self.text, self.hint, self.options)

    def vqa_prompt(self) -> str:
        return short_answer_prompt(self.text)


def _cells(objs: list[Obj]) -> list[tuple[int, int]]:
    return [(o.row, o.col) for o in objs]


def q_color_of_shape(scene: Scene, rng: random.Random) -> Question | None:
    unique = [s for s in SHAPES if sum(o.shape == s for o in scene.objects) == 1]
    if not unique:
        return None
    shape = rng.choice(unique)
    obj = next(o for o in scene.objects if o.shape == shape)
    return Question(
        COLOR_OF_SHAPE, f"what color is the {shape} ?", obj.color, _cells([obj]), keys=[("q", 4), ("q", 4)]
    )


def q_shape_of_color(scene: Scene, rng: random.Random) -> Question | None:
    unique = [c for c in COLORS if sum(o.color == c for o in scene.objects) == 1]
    if not unique:
        return None
    color = rng.choice(unique)
    obj = next(o for o in scene.objects if o.color == color)
    return Question(
        SHAPE_OF_COLOR,
        f"what shape is the {color} object ?",
        obj.shape,
        _cells([obj]),
        keys=[("q", 4), ("q", 4)],
    )


def q_count(scene: Scene, rng: random.Random) -> Question | None:
    present = sorted({o.color for o in scene.objects})
    # mostly colours that are present (counts 1..), sometimes an absent one (count 0)
    color = rng.choice(present) if rng.random() < 0.85 else rng.choice(COLORS)
    objs = [o for o in scene.objects if o.color == color]
    return Question(
        COUNT,
        f"how many {color} objects are there ?",
        str(len(objs)),
        _cells(objs),
        keys=[("q", 2), ("q", 2)],
    )


def q_color_at(scene: Scene, rng: random.Random) -> Question | None:
    obj = rng.choice(scene.objects)
    text = f"what color is the object in row {obj.row + 1} column {obj.col + 1} ?"
    return Question(COLOR_AT, text, obj.color, _cells([obj]), keys=[("q", 7), ("q", 9)])


def _absent_pair(
    scene: Scene, rng: random.Random, kind: str, avoid: set | None = None
) -> tuple[str, str] | None:
    present = {(o.color, o.shape) for o in scene.objects} | (avoid or set())
    absent = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in present]
    if kind == "adversarial":  # shares the colour or the shape with an object in the scene
        colors, shapes = {o.color for o in scene.objects}, {o.shape for o in scene.objects}
        absent = [(c, s) for c, s in absent if c in colors or s in shapes]
    elif kind == "popular":  # shares the colour of an object (the most frequent colours first)
        colors = [o.color for o in scene.objects]
        top = max(colors.count(c) for c in colors)
        absent = [(c, s) for c, s in absent if colors.count(c) == top] or absent
    return rng.choice(absent) if absent else None


def q_exists(
    scene: Scene,
    rng: random.Random,
    answer: str | None = None,
    kind: str = "random",
    avoid: set | None = None,
) -> Question | None:
    answer = answer or rng.choice(["yes", "no"])
    if answer == "yes":
        obj = rng.choice(scene.objects)
        color, shape = obj.color, obj.shape
        targets = _cells([o for o in scene.objects if o.color == obj.color and o.shape == obj.shape])
    else:
        pair = _absent_pair(scene, rng, kind, avoid)
        if pair is None:
            return None
        (color, shape), targets = pair, []
    return Question(EXISTS, exists_text(color, shape), answer, targets, keys=[("q", 3), ("q", 4)])


def exists_text(color: str, shape: str) -> str:
    return f"is there {'an' if color[0] in 'aeiou' else 'a'} {color} {shape} in the image ?"


def q_hint_lookup(scene: Scene, rng: random.Random) -> Question | None:
    """MMBench only: the hint names the cell; the question cannot be answered without it."""
    obj = rng.choice(scene.objects)
    hint = f"the object is in row {obj.row + 1} column {obj.col + 1} ."
    if rng.random() < 0.5:
        text, answer = "what color is this object ?", obj.color
    else:
        text, answer = "what shape is this object ?", obj.shape
    return Question(HINT_LOOKUP, text, answer, _cells([obj]), hint=hint, keys=[("hint", 5), ("hint", 7)])


QUESTION_MAKERS: dict[str, Callable[[Scene, random.Random], Question | None]] = {
    COLOR_OF_SHAPE: q_color_of_shape,
    SHAPE_OF_COLOR: q_shape_of_color,
    COUNT: q_count,
    COLOR_AT: q_color_at,
    EXISTS: q_exists,
    HINT_LOOKUP: q_hint_lookup,
}


def distractor_hint(scene: Scene, q: Question, rng: random.Random) -> str:
    """A true statement about another object, naming a colour and a shape the answer must not copy."""
    others = [o for o in scene.objects if (o.row, o.col) not in q.targets]
    if not others:
        return ""
    o = rng.choice(others)
    return f"the {o.shape} in row {o.row + 1} column {o.col + 1} is {o.color} ."


def to_mmbench(scene: Scene, q: Question, rng: random.Random, hint_mode: str = "none") -> Question:
    """Turn a question into a multiple-choice one: 2 options (yes/no), 3 (counts) or 4 (colours, shapes)."""
    if q.answer in ("yes", "no"):
        options = ["yes", "no"]
    elif q.answer.isdigit():
        k = int(q.answer)
        pool = [str(i) for i in range(0, 9) if i != k]
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


def rotate(q: Question, k: int) -> Question:
    """The k-th circular rotation of a multiple-choice question (option i moves to i - k)."""
    n = len(q.options)
    options = q.options[k % n :] + q.options[: k % n]
    answer_text = q.options[LETTERS.index(q.answer)]
    return Question(q.qtype, q.text, LETTERS[options.index(answer_text)], q.targets, q.hint, options, q.keys)


# ------------------------------------------------------------------------------------------------
# VQA human answers: 10 per question, varied around the canonical answer


def human_answers(answer: str, qtype: str, rng: random.Random) -> list[str]:
    """Ten human answers: at least 4 exactly canonical (so a correct prediction scores 1.0 under either
    normaliser), a minority of wrong answers, and variants (number words, articles, case, punctuation)."""
    n_exact = rng.randint(4, 10)
    n_wrong = min(rng.choice([0, 0, 1, 1, 2]), 10 - n_exact)
    out = [answer] * n_exact
    for _ in range(n_wrong):
        if answer in COLORS:
            out.append(rng.choice([c for c in COLORS if c != answer]))
        elif answer in SHAPES:
            out.append(rng.choice([s for s in SHAPES if s != answer]))
        elif answer.isdigit():
            out.append(str(max(0, int(answer) + rng.choice([-1, 1]))))
        else:
            out.append("no" if answer == "yes" else "yes")
    while len(out) < 10:
        if answer.isdigit() and int(answer) < len(NUMBER_WORDS):
            out.append(
                rng.choice([NUMBER_WORDS[int(answer)], NUMBER_WORDS[int(answer)].capitalize(), answer + "."])
            )
        elif answer in ("yes", "no"):
            out.append(rng.choice([answer.capitalize(), answer + ".", answer + "!"]))
        else:
            out.append(rng.choice([answer.capitalize(), "the " + answer, answer + ".", "a " + answer]))
    rng.shuffle(out)
    return out


# ------------------------------------------------------------------------------------------------
# writing the dev sets


def image_name(image_id: int) -> str:
    return f"COCO_val2014_{image_id:012d}.png"


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------
# the files' records, shared with the 576-token generator


def vqa_records(
    qid: int, image_id: int, q: Question, answer_type: str, rng: random.Random
) -> tuple[dict, dict]:
    """The VQAv2 question and annotation records of `q` (10 human answers drawn from `rng`)."""
    answers = human_answers(q.answer, q.qtype, rng)
    question = {"question_id": qid, "image_id": image_id, "question": q.text}
    annotation = {
        "question_id": qid,
        "image_id": image_id,
        "question_type": q.qtype,
        "answer_type": answer_type,
        "answers": [
            {
                "answer": a,
                "answer_confidence": rng.choice(["yes", "yes", "yes", "maybe"]),
                "answer_id": i + 1,
            }
            for i, a in enumerate(answers)
        ],
        "multiple_choice_answer": q.answer,
    }
    return question, annotation


def write_vqa_files(
    out: Path, info: dict, data_type: str, questions: list[dict], annotations: list[dict]
) -> None:
    atomic_write_text(
        out / "vqav2_dev_questions.json",
        json.dumps(
            {
                "info": info,
                "task_type": "Open-Ended",
                "data_type": data_type,
                "data_subtype": "dev",
                "questions": questions,
            }
        ),
    )
    atomic_write_text(
        out / "vqav2_dev_annotations.json",
        json.dumps({"info": info, "data_type": data_type, "data_subtype": "dev", "annotations": annotations}),
    )


def pope_line(qid: int, image: str, q: Question, kind: str) -> str:
    return json.dumps(
        {"question_id": qid, "image": image, "text": q.text, "label": q.answer, "category": kind}
    )


def mmbench_rows(
    base: int, mq: Question, b64: str, category: str, l2: str, source: str = "synth"
) -> list[list]:
    """The TSV rows of one multiple-choice question: itself and its circular rotations."""
    rows = []
    for k in range(len(mq.options)):
        r = rotate(mq, k)
        opts = r.options + [""] * (4 - len(r.options))
        rows.append(
            [
                base + k * CIRCULAR_OFFSET,
                r.text,
                r.hint,
                *opts,
                r.answer,
                category,
                b64,
                source,
                l2,
                "",
                "dev",
            ]
        )
    return rows


def write_mmbench_tsv(out: Path, rows: list[list]) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_MINIMAL)
    writer.writerow(MMB_COLUMNS)
    writer.writerows(rows)
    atomic_write_text(out / "mmbench_dev.tsv", buf.getvalue())


@dataclass
class DevSizes:
    vqa_images: int = 60  # x 5 question types = 300 VQA questions
    pope_images: int = 50  # x 6 questions (3 yes; random / popular / adversarial no) = 300
    mmbench_questions: int = 150  # base questions; circular rotations are extra rows
    min_objects: int = 3
    max_objects: int = 8

    def validate(self) -> None:
        for name in ("vqa_images", "pope_images", "mmbench_questions"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 3 <= self.min_objects <= self.max_objects <= GRID * GRID:
            raise ConfigError(
                f"dev scenes need 3 <= min_objects <= max_objects <= {GRID * GRID} (a POPE image holds 3 "
                f"yes-questions), got {self.min_objects}..{self.max_objects}"
            )


def _scene_with(rng: random.Random, sizes: DevSizes, makers: list[str]) -> tuple[Scene, list[Question]]:
    """Draw scenes until every requested question type has a question about it."""
    for _ in range(1000):
        scene = make_scene(rng, sizes.min_objects, sizes.max_objects)
        qs = [QUESTION_MAKERS[m](scene, rng) for m in makers]
        if all(q is not None for q in qs):
            return scene, qs  # type: ignore[return-value]
    raise ConfigError(
        f"could not draw a scene answering {makers} with {sizes.min_objects}..{sizes.max_objects} objects"
    )


def generate_dev_sets(out: str | Path, seed: int = 0, sizes: DevSizes | None = None) -> dict[str, int]:
    """Write the dev sets under `out` (images/, vqav2_dev_*.json, pope_dev.jsonl, mmbench_dev.tsv,
    targets.json). Deterministic per seed. Returns the number of items written per file."""
    sizes = sizes or DevSizes()
    sizes.validate()
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out)
    rng = random.Random(f"mm-oval-synth-dev-{seed}")
    targets: dict[str, dict[str, dict]] = {"vqav2": {}, "pope": {}, "mmbench": {}}
    image_id = 1

    # VQAv2: one question of each type per image
    questions, annotations = [], []
    for _ in range(sizes.vqa_images):
        scene, qs = _scene_with(rng, sizes, list(VQA_TYPES))
        atomic_write_bytes(out / "images" / image_name(image_id), png_bytes(scene.render()))
        for k, q in enumerate(qs):
            qid = image_id * 1000 + k
            question, annotation = vqa_records(qid, image_id, q, ANSWER_TYPE[q.qtype], rng)
            questions.append(question)
            annotations.append(annotation)
            targets["vqav2"][str(qid)] = {"type": q.qtype, "answer": q.answer, "targets": q.targets}
        image_id += 1
    info = {"description": "mm-oval synthetic VQAv2-format dev set", "version": "1.0", "seed": seed}
    write_vqa_files(out, info, "synth", questions, annotations)

    # POPE: 3 yes and 3 no (random, popular, adversarial negatives) per image, on new images
    pope_lines = []
    qid = 1
    for _ in range(sizes.pope_images):
        for _attempt in range(1000):
            scene = make_scene(rng, sizes.min_objects, sizes.max_objects)
            pairs = {(o.color, o.shape) for o in scene.objects}
            used: set[tuple[str, str]] = set()
            negs = []
            for kind in ("random", "popular", "adversarial"):
                q = q_exists(scene, rng, "no", kind, avoid=used)
                negs.append(q)
                if q is not None:
                    used.add(tuple(q.text.split()[3:5]))
            if len(pairs) >= 3 and all(negs):
                break
        else:  # pragma: no cover - a 3..8 object scene always works
            raise ConfigError("could not draw a POPE scene")
        atomic_write_bytes(out / "images" / image_name(image_id), png_bytes(scene.render()))
        present = rng.sample(sorted(pairs), 3)
        items = []
        for (color, shape), kind in zip(present, ("random", "popular", "adversarial")):
            cells = _cells([o for o in scene.objects if o.color == color and o.shape == shape])
            items.append(
                (Question(EXISTS, exists_text(color, shape), "yes", cells, keys=[("q", 3), ("q", 4)]), kind)
            )
        items += [(q, kind) for q, kind in zip(negs, ("random", "popular", "adversarial"))]
        rng.shuffle(items)
        for q, kind in items:
            pope_lines.append(pope_line(qid, image_name(image_id), q, kind))
            targets["pope"][str(qid)] = {
                "type": EXISTS,
                "answer": q.answer,
                "targets": q.targets,
                "category": kind,
            }
            qid += 1
        image_id += 1
    atomic_write_text(out / "pope_dev.jsonl", "\n".join(pope_lines) + "\n")

    # MMBench: multiple choice with circular rotations; a fifth of the rows need their hint, a fifth carry
    # a distractor hint
    rows = []
    mmb_types = [COLOR_OF_SHAPE, SHAPE_OF_COLOR, COUNT, COLOR_AT, EXISTS, HINT_LOOKUP]
    for base in range(sizes.mmbench_questions):
        qtype = mmb_types[base % len(mmb_types)]
        scene, (q,) = _scene_with(rng, sizes, [qtype])
        mq = to_mmbench(scene, q, rng, hint_mode="distractor" if rng.random() < 0.3 else "none")
        b64 = base64.b64encode(png_bytes(scene.render())).decode("ascii")
        rows += mmbench_rows(base, mq, b64, *MMB_CATEGORY[qtype])
        targets["mmbench"][str(base)] = {
            "type": qtype,
            "answer": mq.options[LETTERS.index(mq.answer)],
            "targets": q.targets,
            "hint": "needed" if qtype == HINT_LOOKUP else ("distractor" if mq.hint else "none"),
        }
    write_mmbench_tsv(out, rows)

    meta = {
        "seed": seed,
        "grid": GRID,
        "cell_px": CELL,
        "image_size": IMAGE_SIZE,
        "targets_are": "0-based (row, col) cells; patch index = row * 8 + col; questions number rows/columns from 1",
    }
    atomic_write_text(out / "targets.json", json.dumps({"meta": meta, **targets}, indent=0))
    counts = {
        "vqav2": len(questions),
        "pope": len(pope_lines),
        "mmbench_rows": len(rows),
        "mmbench_questions": sizes.mmbench_questions,
    }
    log.info("wrote %s to %s", counts, out)
    return counts


# ------------------------------------------------------------------------------------------------
# the train split, drawn on the fly


@dataclass
class TrainItem:
    scene: Any  # a Scene of this module or of scenes.py (the 576-token benchmark)
    image: Image.Image
    questions: list[Question]  # VQA-style (no options), MMBench-style (options, answer is a letter), lists


def check_sampler_options(mmbench_fraction: float, type_weights: dict[str, float] | None, kinds) -> None:
    """A train sampler's options: the MMBench share in [0, 1]; type weights of known `kinds`, none negative."""
    if not 0.0 <= mmbench_fraction <= 1.0:
        raise ConfigError(f"mmbench_fraction must be in [0, 1], got {mmbench_fraction}")
    unknown = set(type_weights or {}) - set(kinds)
    if unknown or any(w < 0 for w in (type_weights or {}).values()):
        raise ConfigError(
            f"type_weights: unknown types {sorted(unknown)} or negative weights; types: {list(kinds)}"
        )


class TrainSampler:
    """Draws training scenes with many questions each (VQA-style and MMBench-style, balanced yes/no).
    Seeded: the same (seed, index) gives the same item."""

    def __init__(
        self,
        seed: int,
        min_objects: int = 3,
        max_objects: int = 8,
        mmbench_fraction: float = 0.3,
        type_weights: dict[str, float] | None = None,
    ):
        check_sampler_options(mmbench_fraction, type_weights, TRAIN_KINDS)
        # None keeps the uniform draw (and its random stream); otherwise relative weights, default 1
        self.type_weights = [float(type_weights.get(k, 1.0)) for k in TRAIN_KINDS] if type_weights else None
        make_scene(random.Random(0), min_objects, max_objects)  # validates the counts
        self.seed, self.min_objects, self.max_objects = seed, min_objects, max_objects
        self.mmbench_fraction = mmbench_fraction

    def item(self, index: int, n_questions: int) -> TrainItem:
        rng = random.Random(f"mm-oval-synth-train-{self.seed}-{index}")
        scene = make_scene(rng, self.min_objects, self.max_objects)
        questions: list[Question] = []
        tries = 0
        while len(questions) < n_questions and tries < 20 * n_questions:
            tries += 1
            if self.type_weights is None:
                qtype = rng.choice(TRAIN_KINDS)
            else:
                qtype = rng.choices(TRAIN_KINDS, weights=self.type_weights)[0]
            if qtype == HINT_LOOKUP and rng.random() > self.mmbench_fraction:
                continue
            if qtype == EXISTS:
                q = q_exists(scene, rng, kind=rng.choice(["random", "popular", "adversarial"]))
            else:
                q = QUESTION_MAKERS[qtype](scene, rng)
            if q is None:
                continue
            if qtype == HINT_LOOKUP or rng.random() < self.mmbench_fraction:
                q = to_mmbench(scene, q, rng, hint_mode="distractor" if rng.random() < 0.3 else "none")
            questions.append(q)
        return TrainItem(scene, scene.render(), questions)
