"""Scenes at LLaVA-1.5's geometry: 336x336 images cut into a 24x24 grid of 14 px patches (576 image tokens).

A scene holds up to 12 coloured shapes, each covering several patches (bounding boxes of 2x2 to 5x5
patches), on a textured background (smooth dark noise, so no two empty patches look alike). Every object's
centre sits on a patch centre, centres differ in column and in row from every other object's (so "left to
right" and "top to bottom" orders are strict), objects keep at least one patch of empty space between
their bounding boxes, two for objects of one colour (so a patch belongs to at most one object, two objects
never touch, and no member patch of an object neighbours one of another object of its colour), and none
touches the first or last patch column.

Questions speak of a coarse 6x6 grid of regions (4x4 patches each, rows and columns numbered 1..6, row 1
at the top); an object is *in* the region that holds its centre.

A patch is a *member* of an object when the object covers at least `MEMBER_COVERAGE` of its pixels; the
generator knows every object's member patches (`Scene.members`), which are the targets of its questions.

Everything is a pure function of the seed (`make_scene(random.Random(seed))`).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from PIL import Image, ImageDraw

from ..errors import ConfigError
from .vocab import COLORS, SHAPES

GRID = 24  # patches per side
PATCH = 14  # pixels per patch side
IMAGE_SIZE = GRID * PATCH  # 336
REGIONS = 6  # coarse regions per side in questions
REGION_PATCHES = GRID // REGIONS  # 4
SIZES = (2, 3, 4, 5)  # bounding-box side in patches
MAX_OBJECTS = 12
MAX_PER_COLOR = 5  # counts are 0..5
MEMBER_COVERAGE = 0.3
PALETTE = 64

RGB = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (40, 80, 235),
    "yellow": (240, 225, 30),
    "purple": (150, 40, 200),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
    "pink": (250, 150, 205),
}
assert set(RGB) == set(COLORS)


@dataclass(frozen=True)
class Obj:
    """One object: colour, shape, bounding-box side `size` (patches) and centre (cx, cy) in patch units
    (a patch centre: k + 0.5). `cx` grows to the right, `cy` downwards."""

    color: str
    shape: str
    size: int
    cx: float
    cy: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        """Pixel bounding box (x0, y0, x1, y1)."""
        h = self.size * PATCH / 2
        x, y = self.cx * PATCH, self.cy * PATCH
        return (x - h, y - h, x + h, y + h)

    @property
    def region(self) -> tuple[int, int]:
        """0-based (row, col) of the coarse region holding the centre."""
        return (int(self.cy) // REGION_PATCHES, int(self.cx) // REGION_PATCHES)

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"


def draw_shape(draw: ImageDraw.ImageDraw, o: Obj, fill) -> None:
    x0, y0, x1, y1 = o.box
    w = x1 - x0
    if o.shape == "circle":
        draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
    elif o.shape == "square":
        m = 0.08 * w
        draw.rectangle([x0 + m, y0 + m, x1 - 1 - m, y1 - 1 - m], fill=fill)
    elif o.shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)
    elif o.shape == "cross":
        a = 0.2 * w  # half the arm width: arms 0.4 of the box
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        draw.rectangle([x0, cy - a, x1 - 1, cy + a - 1], fill=fill)
        draw.rectangle([cx - a, y0, cx + a - 1, y1 - 1], fill=fill)
    else:  # pragma: no cover - shapes come from SHAPES
        raise ConfigError(f"unknown shape {o.shape!r}")


LEVELS = PALETTE - len(COLORS)  # background shades


def _ramp() -> np.ndarray:
    t = np.linspace(0.0, 1.0, LEVELS)[:, None]
    return np.round((1 - t) * np.array([22.0, 26.0, 38.0]) + t * np.array([88.0, 80.0, 66.0])).astype(
        np.uint8
    )


RAMP = _ramp()


def background(seed: int) -> np.ndarray:
    """A smooth dark noise texture (H, W) of palette indices (`LEVELS` shades of one ramp), different in
    every patch."""
    rng = np.random.default_rng(seed)
    field = np.zeros((IMAGE_SIZE, IMAGE_SIZE), np.float32)
    for cells, amp in ((6, 0.7), (24, 0.3)):
        coarse = rng.uniform(0, 255, size=(cells, cells)).astype(np.uint8)
        img = Image.fromarray(coarse).resize((IMAGE_SIZE, IMAGE_SIZE), Image.BICUBIC)
        field += np.asarray(img, np.float32) / 255.0 * amp
    return np.clip((field * LEVELS).astype(np.int64), 0, LEVELS - 1).astype(np.uint8)


PALETTE_RGB = np.concatenate([RAMP, np.array([RGB[c] for c in COLORS], np.uint8)])


@dataclass
class Scene:
    objects: list[Obj]
    texture_seed: int = 0

    def indices(self) -> Image.Image:
        """The image as palette indices ("L"): background shades, then each object drawn (no antialiasing)
        in the index of its colour."""
        img = Image.fromarray(background(self.texture_seed), "L")
        draw = ImageDraw.Draw(img)
        for o in self.objects:
            draw_shape(draw, o, LEVELS + COLORS.index(o.color))
        return img

    def render(self) -> Image.Image:
        """The RGB image: every pixel is one of the `PALETTE` colours (`PALETTE_RGB`)."""
        return Image.fromarray(PALETTE_RGB[np.asarray(self.indices())])

    def png_bytes(self) -> bytes:
        """The image as a palette PNG (about 15 KB), pixel for pixel what `render` gives."""
        img = self.indices().convert("P")
        img.putpalette(PALETTE_RGB.flatten().tolist())
        buf = io.BytesIO()
        img.save(buf, "PNG", optimize=True)
        return buf.getvalue()

    @cached_property
    def members(self) -> list[list[tuple[int, int]]]:
        """Per object, its member patches (0-based (row, col)): the object covers >= MEMBER_COVERAGE of them."""
        out = []
        for o in self.objects:
            mask = Image.new("L", (IMAGE_SIZE, IMAGE_SIZE), 0)
            draw_shape(ImageDraw.Draw(mask), o, 255)
            m = np.asarray(mask, np.float32).reshape(GRID, PATCH, GRID, PATCH).mean(axis=(1, 3)) / 255.0
            out.append([(int(r), int(c)) for r, c in zip(*np.nonzero(m >= MEMBER_COVERAGE))])
        return out

    def left_to_right(self) -> list[Obj]:
        return sorted(self.objects, key=lambda o: o.cx)

    def top_to_bottom(self) -> list[Obj]:
        return sorted(self.objects, key=lambda o: o.cy)

    def patch_labels(self) -> np.ndarray:
        """(576, 5) float per patch: colour (0 = none, 1..8), shape (0 = none, 1..4), and for member patches
        the object's centre column and row in patch units (cx, cy; -1 for non-members), then the size."""
        lab = np.zeros((GRID * GRID, 5), np.float32)
        lab[:, 2:] = -1.0
        for o, mem in zip(self.objects, self.members):
            for r, c in mem:
                p = r * GRID + c
                lab[p] = (COLORS.index(o.color) + 1, SHAPES.index(o.shape) + 1, o.cx, o.cy, o.size)
        return lab


def _fits(o: Obj, placed: list[Obj]) -> bool:
    h = o.size / 2
    # one empty patch column at the left and right borders: in the image tokens' raster order a patch's
    # left / upper-left / upper-right neighbours never wrap round to an object at the other border
    if o.cx - h < 1 or o.cy - h < 0 or o.cx + h > GRID - 1 or o.cy + h > GRID:
        return False
    for p in placed:
        if o.cx == p.cx or o.cy == p.cy:  # strict left-right and top-bottom orders
            return False
        # one empty patch between bounding boxes, two between objects of one colour (their member patches,
        # which reach into a half-covered patch, are then never neighbours)
        gap = 2.0 if o.color == p.color else 1.0
        if abs(o.cx - p.cx) < h + p.size / 2 + gap and abs(o.cy - p.cy) < h + p.size / 2 + gap:
            return False
    return True


def make_scene(
    rng: random.Random, min_objects: int = 4, max_objects: int = MAX_OBJECTS, tries: int = 400
) -> Scene:
    """A scene of min..max objects (colours, shapes and sizes uniform), placed by rejection sampling; a
    (colour, shape) pair appears at most once, so every object is named by its colour and shape, and no
    colour more than MAX_PER_COLOR times. A crowded draw may place fewer than asked (never fewer than
    min_objects: the draw restarts)."""
    if not 1 <= min_objects <= max_objects <= MAX_OBJECTS:
        raise ConfigError(
            f"object counts must satisfy 1 <= min_objects <= max_objects <= {MAX_OBJECTS}, "
            f"got min_objects={min_objects}, max_objects={max_objects}"
        )
    n = rng.randint(min_objects, max_objects)
    placed: list[Obj] = []
    names: set[tuple[str, str]] = set()
    for t in range(tries):
        if len(placed) == n:
            break
        if t == tries - 1 and len(placed) < min_objects:  # pragma: no cover - 400 tries always suffice
            raise ConfigError(f"could not place {min_objects} objects in {tries} tries")
        color, shape, size = rng.choice(COLORS), rng.choice(SHAPES), rng.choice(SIZES)
        if (color, shape) in names or sum(o.color == color for o in placed) >= MAX_PER_COLOR:
            continue
        h = size / 2
        cx = rng.randint(int(np.ceil(h + 0.5)), int(GRID - h - 1.5)) + 0.5
        cy = rng.randint(int(np.ceil(h - 0.5)), int(GRID - h - 0.5)) + 0.5
        o = Obj(color, shape, size, cx, cy)
        if _fits(o, placed):
            placed.append(o)
            names.add((color, shape))
    return Scene(placed, texture_seed=rng.randrange(2**31))
